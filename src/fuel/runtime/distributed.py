"""The distributed runtime: a tensor-parallel run as one process per rank on torch.distributed.

Decides how ``fuel run --tp N`` executes: the parent checks the split (a model whose heads,
columns or vocabulary do not divide is refused before any process starts), picks a free port
on 127.0.0.1, and spawns N processes (``torch.multiprocessing``, start method ``spawn``). Each
rank joins the process group (gloo: fuel's executor runs on the CPU; an NCCL group belongs
with a CUDA executor, which fuel does not have yet), builds its own
rank circuit (:func:`fuel.circuit.parallel.rank_circuit`), binds its slice of every checkpoint
tensor (:func:`shard_weights`), fuses, lowers and runs its own plans; the collective nodes of
those plans are the only communication. Every rank computes the same greedy tokens (the logits
are all-gathered); rank 0 reports them with its logits and every rank's plan digests.

Invariants:
- No rank runs a program before every rank has joined the group; a rank that fails makes
  the whole run fail with that rank's error (never a partial answer).
- The per-step logits rank 0 returns are the gathered full-vocabulary rows, comparable to a
  single-process run's row for row (:func:`greedy_logits` runs both).
- A sharded tensor is a contiguous copy of the checkpoint's slice, so a rank holds only its
  part (plus the replicated norms and whatever the split replicates).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fuel.circuit.ir import Circuit
from fuel.circuit.parallel import Parallel, rank_circuit, split_shape
from fuel.errors import FuelError

__all__ = [
    "DistributedRunFailed", "TensorParallelResult", "free_port", "greedy_logits",
    "run_tensor_parallel", "shard_weights",
]


class DistributedRunFailed(FuelError):
    """A rank of a distributed run failed; carries the rank's message."""


@dataclass(frozen=True, slots=True)
class TensorParallelResult:
    """What a tensor-parallel run produced: the greedy tokens, rank 0's logits per generated
    token (``[tokens, vocab]``, f32), every rank's plan digests (mode/rows -> digest) and the
    backend the group used."""

    tp: int
    tokens: tuple[int, ...]
    logits: Any
    digests: tuple[Mapping[str, str], ...]
    backend: str


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shard_weights(weights: Any, circuit: Circuit) -> Any:
    """``weights`` as rank ``circuit.rank`` binds them: each sharded tensor replaced by a
    contiguous copy of its slice (names unchanged), every other tensor whole."""
    if circuit.rank is None:
        return weights
    shards = dict(circuit.rank.shards)
    tensors = {}
    for name, tensor in weights.tensors.items():
        shard = shards.get(name)
        tensors[name] = tensor if shard is None else tensor.narrow(
            shard.dim, shard.start, shard.end - shard.start).contiguous()
    return replace(weights, tensors=tensors)


def greedy_logits(engine: Any, prompt: Sequence[int], max_new_tokens: int):
    """Prefill ``prompt`` and decode greedily: ``(tokens, logits)`` with one f32 logits row
    ``[vocab]`` per generated token (the row that chose it). A one-token prompt is fed as a
    decode step (one program serves the whole run)."""
    import torch

    from fuel.circuit.rules import Mode
    from fuel.runtime.generate import prefill

    sequence = "tp"
    engine.add_sequence(sequence)
    try:
        result = (engine.step(Mode.DECODE, [(sequence, list(prompt))]) if len(prompt) == 1
                  else prefill(engine, sequence, list(prompt), last_only=True))
        rows, tokens = [result.logits[-1].float()], [result.tokens[-1]]
        while len(tokens) < max_new_tokens:
            result = engine.step(Mode.DECODE, [(sequence, [tokens[-1]])])
            rows.append(result.logits[-1].float())
            tokens.append(result.tokens[-1])
    finally:
        engine.free(sequence)
    return tokens, torch.stack(rows)


def _rank_main(rank: int, tp: int, port: int, folder: str, dtype: str, prompt: Sequence[int],
               max_new_tokens: int, max_context: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    from fuel.circuit import zoo
    from fuel.circuit.config_map import shape_from_config
    from fuel.runtime.engine import Engine
    from fuel.runtime.weights import load_weights

    torch.set_num_threads(1)
    # fuel's executor runs on the CPU, so the group is gloo; NCCL needs the CUDA executor.
    backend = "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=tp)
    try:
        weights = load_weights(folder, dtype=dtype, progress=False)
        full = zoo.circuit_for(shape_from_config(dict(weights.config), folder))
        circuit = rank_circuit(full, Parallel(tp=tp), rank)
        engine = Engine(shard_weights(weights, circuit), circuit=circuit,
                        max_context=max_context, max_sequences=1)
        tokens, logits = greedy_logits(engine, prompt, max_new_tokens)
        digests = dict(sorted(engine.stats.digests.items(), key=lambda kv: kv[1]))
        # By value (numpy): a shared-memory tensor would not outlive this process.
        queue.put((rank, tokens, logits.numpy() if rank == 0 else None, digests, backend, None))
    except Exception as error:  # reported to the parent, which raises it as the run's error
        queue.put((rank, None, None, None, backend, f"{type(error).__name__}: {error}"))
        raise
    finally:
        dist.destroy_process_group()


def run_tensor_parallel(weights: Any, prompt: Sequence[int], max_new_tokens: int, tp: int, *,
                        max_context: int = 256, port: int | None = None) -> TensorParallelResult:
    """Run ``prompt`` greedily over ``tp`` ranks on localhost. ``weights`` are the loaded
    model's (its converted folder is what each rank reads). Raises
    :class:`fuel.circuit.parallel.SplitRefused` before starting any process when the model
    does not split ``tp`` ways."""
    import torch.multiprocessing as mp

    from fuel.circuit.config_map import shape_from_config

    folder = str(Path(weights.source.folder))
    split_shape(shape_from_config(dict(weights.config), folder), Parallel(tp=tp))
    queue = mp.get_context("spawn").SimpleQueue()
    port = port or free_port()
    processes = mp.start_processes(
        _rank_main, args=(tp, port, folder, weights.dtype.value, list(prompt), max_new_tokens,
                          max_context, queue),
        nprocs=tp, join=False, start_method="spawn")
    results: list[tuple] = []
    try:
        # Drain the queue while the ranks run: a result larger than the pipe's buffer would
        # otherwise block its rank, and the join, forever.
        done = False
        while len(results) < tp or not done:
            while not queue.empty():
                results.append(queue.get())
            if not done:
                done = processes.join(timeout=0.05)
    except Exception as error:
        while not queue.empty():
            results.append(queue.get())
        messages = [f"rank {r[0]}: {r[-1]}" for r in results if r[-1]]
        raise DistributedRunFailed("tensor-parallel run failed: "
                                   + ("; ".join(messages) or str(error))) from None
    import torch

    results.sort(key=lambda r: r[0])
    tokens = results[0][1]
    if any(r[1] != tokens for r in results):
        raise DistributedRunFailed(f"ranks disagree on the greedy tokens: "
                                   f"{[r[1] for r in results]}")
    return TensorParallelResult(tp, tuple(tokens), torch.from_numpy(results[0][2]),
                                tuple(r[3] for r in results), results[0][4])
