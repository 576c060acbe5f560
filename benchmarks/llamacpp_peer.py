"""Run by the llama.cpp peer's interpreter (llama-cpp-python), never imported by fuel: greedy
decode of given prompt token ids on a GGUF, with the decode rate and each step's top-2 logits.

Usage: ``PEER_PYTHON benchmarks/llamacpp_peer.py MODEL.gguf THREADS TOKENS IDS_JSON`` prints one
JSON object ``{"runs": [{"tokens": [...], "top2": [[l1, l2], ...], "decode_s": s}, ...]}``
(``IDS_JSON`` is a list of prompt id lists; ``decode_s`` times tokens 2..N, as fuel's decode
rate does).
"""

import json
import sys
import time

import numpy as np
from llama_cpp import Llama


def main() -> None:
    model, threads, tokens, ids = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    llm = Llama(model_path=model, n_ctx=512, n_batch=512, n_threads=threads,
                n_threads_batch=threads, logits_all=True, verbose=False)
    runs = []
    for prompt in ids:
        llm.reset()
        llm.eval(prompt)
        out, top2, started = [], [], None
        for step in range(tokens):
            row = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            best = np.argsort(row)[-2:][::-1]
            out.append(int(best[0]))
            top2.append([float(row[best[0]]), float(row[best[1]])])
            if step == 1:
                started = time.perf_counter()
            llm.eval([int(best[0])])
        decode_s = time.perf_counter() - started if started is not None else 0.0
        runs.append({"tokens": out, "top2": top2, "decode_s": decode_s, "decode_tokens": tokens - 1})
    print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
