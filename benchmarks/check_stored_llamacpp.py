"""Check: fuel's stored-format run of the shipped SmolLM2 Q4_1 GGUF against llama.cpp on the
same file: greedy tokens of several prompts agree for at least the first 16 tokens.

Run: ``.venv/bin/python benchmarks/check_stored_llamacpp.py [--llama-python /work/peer/llama/bin/python]
[--tokens 24] [--threads 2]``. Both runs see the same prompt token ids (fuel's tokenizer and chat
template). llama.cpp quantizes activations to 8 bits in its Q4_1/Q8_0 matmuls while fuel keeps
them f32, so a later divergence is expected; where one appears the script prints llama.cpp's two
top logits at that step (a near tie explains the flip). Not CI: it needs the llama.cpp peer.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PROMPTS = ("Name a planet.", "Write one sentence about the moon.",
           "What is the capital of France?", "List three colors.")
AGREE = 16


def llamacpp_runs(python: str, model: Path, threads: int, tokens: int, ids: list[list[int]]):
    script = Path(__file__).with_name("llamacpp_peer.py")
    done = subprocess.run([python, str(script), str(model), str(threads), str(tokens), json.dumps(ids)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp peer failed ({python}): {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout)["runs"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", default="/work/peer/llama/bin/python")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if not Path(args.llama_python).is_file():
        print(f"--llama-python {args.llama_python}: no such interpreter (the llama.cpp peer)")
        return 2

    from fuel.runtime.generate import generate
    from fuel.runtime.model import load_model, set_threads
    from fuel.runtime.weights import default_model_path

    set_threads(args.threads)
    model = load_model(None, dtype="stored", max_context=512, progress=False, jit=True)
    tok = model.tokenizer
    ids = [tok.encode(tok.format_prompt(p)) for p in PROMPTS]
    peer = llamacpp_runs(args.llama_python, default_model_path(), args.threads, args.tokens, ids)
    worst = args.tokens
    for prompt, prompt_ids, theirs in zip(PROMPTS, ids, peer):
        ours = list(generate(model.engine, prompt_ids, args.tokens).tokens)
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs["tokens"])) if a != b),
                    min(len(ours), len(theirs["tokens"])))
        worst = min(worst, same)
        line = f"{prompt!r}: {same} of {args.tokens} greedy tokens agree"
        if same < min(len(ours), len(theirs["tokens"])):
            top = theirs["top2"][same]
            line += (f"; at step {same} fuel {ours[same]} vs llama.cpp {theirs['tokens'][same]}, "
                     f"llama.cpp's top-2 logits {top[0]:.4f} / {top[1]:.4f} (gap {top[0] - top[1]:.4f})")
        print(line)
    print(f"fewest agreeing tokens: {worst} (target >= {AGREE})")
    return 0 if worst >= AGREE else 1


if __name__ == "__main__":
    sys.exit(main())
