"""Greedy generation over the engine: prefill in chunks, then decode (one sequence) or
multi_seq (several sequences, one row each).

Decides the order of steps and nothing about how a step runs (that is the engine's). The KV
state after a call: the cache holds every committed token but the last generated one (the
*pending* token, which the next step feeds).

Invariants:
- A prompt is prefilled in chunks of ``chunk`` rows and one last chunk of the rest, each a
  whole chunk of causal attention in one kernel. The last chunk runs *padded* to the next of
  16, 24, 32, 48 ... rows (:func:`bucket`), so every prompt up to ``chunk`` tokens runs one of
  nine programs (16, 24, 32, 48, 64, 96, 128, 192, 256 rows) and programs persist across processes
  (:mod:`fuel.runtime.program_cache`): a new prompt length builds nothing a machine built
  before. Padding rows repeat the last token after the real ones; attention is causal, so no
  real row sees them, and their cache writes are rolled back (the sequence's length returns to
  the real end, and the next step overwrites those slots). Their logits are dropped. Where the
  context or the free blocks cannot hold the padding, the chunk runs at its own size.
- The last real row of the last chunk picks the first new token.
- Generation stops after ``max_new_tokens`` tokens or right after a token in ``stop`` (the stop
  token is returned); the output is exactly the greedy continuation, one argmax per step.
- ``generate_batch`` steps all unfinished sequences together in one ``multi_seq`` step; a
  finished sequence drops out (rows shrink) and its blocks are freed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from fuel.circuit.ir import Section
from fuel.circuit.rules import Mode
from fuel.runtime.engine import ContextTooLong, Engine, StepResult

DEFAULT_CHUNK = 256
"""Rows of a full prefill chunk: a 512-token prompt is two steps of one program; a chat prompt
(tens of tokens) one step."""


MIN_BUCKET = 16
"""The smallest padded prefill chunk (shorter prompts run 16 rows)."""


def bucket(rows: int, largest: int = DEFAULT_CHUNK) -> int:
    """The rows a chunk of ``rows`` runs at: the next of 16, 24, 32, 48, 64, 96 ... (a power of
    two from :data:`MIN_BUCKET`, or one and a half times one), and never more than ``largest``
    (a chunk of ``largest`` rows runs as it is). Half-steps keep the padding under a third of
    the rows (a 41-token chat prompt runs 48 rows, not 64: its prefill a quarter shorter) for
    nine programs up to 256 rows instead of five."""
    size = MIN_BUCKET
    while size < rows:
        size = size * 3 // 2 if size & (size - 1) == 0 else size // 3 * 4
    return max(rows, min(size, largest))


def chunks(length: int, largest: int = DEFAULT_CHUNK) -> list[int]:
    """Split ``length`` rows into chunks of ``largest`` rows and one last chunk of the rest
    (at most two distinct sizes, so at most two programs per prompt)."""
    if length < 1 or largest < 1:
        raise ValueError(f"cannot chunk {length} rows at most {largest} each")
    full, rest = divmod(length, largest)
    return [largest] * full + ([rest] if rest else [])


def prefill(engine: Engine, sequence: Hashable, ids: Sequence[int], *, chunk: int = DEFAULT_CHUNK,
            mode: Mode = Mode.PREFILL, last_only: bool = False) -> StepResult:
    """Feed ``ids`` to ``sequence`` in chunks (``mode`` prefill, or draft for the draft head);
    returns the last chunk's step. ``last_only``: each chunk computes the logits of its last
    (real) row alone, and the result holds that one row (all a generation reads: the LM head
    then multiplies one row, not the chunk's); else every row's."""
    result, start = None, 0
    for size in chunks(len(ids), chunk):
        part = list(ids[start:start + size])
        padded = bucket(size, chunk) if mode is Mode.PREFILL else size
        rows = [size - 1] if last_only else None
        if padded > size and _room(engine, sequence, padded):
            length = engine.length(sequence)
            result = engine.step(mode, [(sequence, part + [part[-1]] * (padded - size))],
                                 logit_rows=rows)
            engine.rollback(sequence, length + size)
            if not last_only:
                result = StepResult(result.logits[:size], result.tokens[:size], result.program,
                                    result.node_seconds)
        else:
            result = engine.step(mode, [(sequence, part)], logit_rows=rows)
        start += size
    assert result is not None
    return result


def _room(engine: Engine, sequence: Hashable, rows: int) -> bool:
    """Whether ``sequence`` can take ``rows`` more rows (context and free blocks)."""
    tables = engine.tables[Section.MAIN]
    return (engine.length(sequence) + rows <= engine.max_context
            and tables.can_append(sequence, rows))


@dataclass(slots=True)
class Timing:
    """Wall time of the prefill and of the token-producing steps after it."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass(slots=True)
class Generation:
    prompt: tuple[int, ...]
    tokens: list[int] = field(default_factory=list)
    timing: Timing = field(default_factory=Timing)


def _check_room(engine: Engine, sequence: Hashable, prompt: Sequence[int], max_new_tokens: int,
                slack: int = 0) -> None:
    needed = len(prompt) + max_new_tokens + slack
    if needed > engine.max_context:
        raise ContextTooLong(sequence, needed, engine.max_context)


def _done(tokens: list[int], max_new_tokens: int, stop: Sequence[int]) -> bool:
    return len(tokens) >= max_new_tokens or (bool(tokens) and tokens[-1] in stop)


def generate(engine: Engine, prompt: Sequence[int], max_new_tokens: int, *,
             stop: Sequence[int] = (), sequence: Hashable = "gen",
             on_token: Callable[[int], None] | None = None, chunk: int = DEFAULT_CHUNK) -> Generation:
    """Greedy continuation of ``prompt`` (plain decode); the sequence is freed at the end."""
    if not prompt:
        raise ValueError("an empty prompt has nothing to continue")
    _check_room(engine, sequence, prompt, max_new_tokens)
    out = Generation(tuple(prompt))
    engine.add_sequence(sequence)
    try:
        started = time.perf_counter()
        result = prefill(engine, sequence, list(prompt), chunk=chunk, last_only=True)
        token = result.tokens[-1]
        out.timing.prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        while max_new_tokens > 0:
            out.tokens.append(token)
            if on_token is not None:
                on_token(token)
            if _done(out.tokens, max_new_tokens, stop):
                break
            token = engine.step(Mode.DECODE, [(sequence, [token])]).tokens[-1]
            out.timing.decode_tokens += 1
        out.timing.decode_s = time.perf_counter() - started
    finally:
        engine.free(sequence)
    return out


def generate_batch(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                   stop: Sequence[int] = (), chunk: int = DEFAULT_CHUNK) -> list[Generation]:
    """Greedy continuations of several prompts, decoded together (``multi_seq`` steps)."""
    names = [f"batch{i}" for i in range(len(prompts))]
    for name, prompt in zip(names, prompts):
        _check_room(engine, name, prompt, max_new_tokens)
    outs = [Generation(tuple(prompt)) for prompt in prompts]
    pending: dict[str, int] = {}
    try:
        for name, prompt, out in zip(names, prompts, outs):
            engine.add_sequence(name)
            started = time.perf_counter()
            pending[name] = prefill(engine, name, list(prompt), chunk=chunk,
                                    last_only=True).tokens[-1]
            out.timing.prefill_s = time.perf_counter() - started
        live = [i for i in range(len(prompts)) if max_new_tokens > 0]
        started = time.perf_counter()
        while live:
            for i in live:
                outs[i].tokens.append(pending[names[i]])
            live = [i for i in live if not _done(outs[i].tokens, max_new_tokens, stop)]
            for i, name in enumerate(names):
                if i not in live and name in pending:
                    engine.free(name)
                    del pending[name]
            if not live:
                break
            result = engine.step(Mode.MULTI_SEQ, [(names[i], [pending[names[i]]]) for i in live])
            for i, token in zip(live, result.tokens):
                pending[names[i]] = token
                outs[i].timing.decode_tokens += 1
        elapsed = time.perf_counter() - started
        for out in outs:
            out.timing.decode_s = elapsed
    finally:
        for name in names:
            engine.free(name)
    return outs


__all__ = ["DEFAULT_CHUNK", "Generation", "Timing", "chunks", "generate", "generate_batch", "prefill"]
