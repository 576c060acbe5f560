"""Speculative decoding: a drafter proposes k tokens, one verify step checks them, greedy
acceptance keeps the agreeing prefix plus the model's own next token, and the KV cache rows of
rejected drafts are rolled back.

Decides the round structure and the drafters. The output is, by construction, the plain greedy
continuation: every emitted token is the main model's argmax given the tokens before it (a
draft token is kept only when it equals that argmax); drafting only changes how many tokens one
main-model step yields.

Drafters (:class:`Drafter`):

- :class:`EarlyExitDrafter` runs the circuit's draft section (``draft`` mode: a layer-0
  early-exit head over the model's own weights) with its own KV cache; it catches up on the
  tokens it has not seen in one draft step, then drafts one token per step.
- :class:`PromptLookupDrafter` copies the tokens that followed the latest earlier occurrence of
  the context's last n-gram (no model at all: strong on repetitive or quoting outputs).

Invariants:
- After a round, the main cache holds exactly the committed tokens but the pending one; the
  draft cache holds the longest prefix of the committed tokens it had processed (rollback).
- ``accepted <= proposed``; the acceptance rate is ``accepted / proposed`` over all rounds.
- With several sequences (``speculative_generate_batch``), their verify rows form one
  ``verify_batch`` step whose row table follows each sequence's k.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fuel.circuit.ir import Section
from fuel.circuit.rules import Mode
from fuel.runtime.engine import Engine
from fuel.runtime.generate import Generation, _check_room, _done, prefill


class Drafter(Protocol):
    """Proposes up to ``k`` next tokens for a sequence whose committed tokens are ``context``."""

    name: str

    def propose(self, engine: Engine, sequence: Hashable, context: Sequence[int], k: int) -> list[int]: ...

    def sync(self, engine: Engine, sequence: Hashable, context: Sequence[int]) -> None:
        """The committed tokens changed to ``context``: drop state that disagrees."""

    def release(self, engine: Engine, sequence: Hashable) -> None: ...


class EarlyExitDrafter:
    """The circuit's draft head (draft mode) with its own KV cache slots."""

    name = "early-exit"

    def __init__(self) -> None:
        self._fed: dict[Hashable, list[int]] = {}

    def propose(self, engine: Engine, sequence: Hashable, context: Sequence[int], k: int) -> list[int]:
        fed = self._fed.setdefault(sequence, [])
        catch_up = list(context[len(fed):])
        result = prefill(engine, sequence, catch_up, mode=Mode.DRAFT, last_only=True)
        fed += catch_up
        drafts = [result.tokens[-1]]
        while len(drafts) < k:
            token = engine.step(Mode.DRAFT, [(sequence, [drafts[-1]])]).tokens[-1]
            fed.append(drafts[-1])
            drafts.append(token)
        return drafts

    def sync(self, engine: Engine, sequence: Hashable, context: Sequence[int]) -> None:
        fed = self._fed.get(sequence, [])
        keep = 0
        while keep < len(fed) and keep < len(context) and fed[keep] == context[keep]:
            keep += 1
        if keep < len(fed):
            engine.rollback(sequence, keep, Section.DRAFT)
            del fed[keep:]

    def release(self, engine: Engine, sequence: Hashable) -> None:
        self._fed.pop(sequence, None)


class PromptLookupDrafter:
    """Drafts by copying what followed the latest earlier match of the context's last n-gram."""

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def propose(self, engine: Engine, sequence: Hashable, context: Sequence[int], k: int) -> list[int]:
        tokens = list(context)
        for size in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            tail = tokens[-size:]
            for start in range(len(tokens) - size - 1, -1, -1):
                if tokens[start:start + size] == tail:
                    follow = tokens[start + size:start + size + k]
                    if follow:
                        return follow
        return []

    def sync(self, engine: Engine, sequence: Hashable, context: Sequence[int]) -> None:
        return None

    def release(self, engine: Engine, sequence: Hashable) -> None:
        return None


@dataclass(slots=True)
class SpeculationStats:
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass(slots=True)
class SpeculativeGeneration(Generation):
    speculation: SpeculationStats = field(default_factory=SpeculationStats)


def accept(drafts: Sequence[int], predictions: Sequence[int]) -> int:
    """Greedy acceptance: how many leading drafts equal the model's prediction before them
    (``predictions[i]`` is the model's token after the pending token and ``drafts[:i]``)."""
    count = 0
    while count < len(drafts) and drafts[count] == predictions[count]:
        count += 1
    return count


def _round(engine: Engine, batch: list[tuple[Hashable, list[int], list[int]]],
           stats: Sequence[SpeculationStats]) -> list[list[int]]:
    """One verify (or verify_batch) step over ``(sequence, context, drafts)``; returns each
    sequence's new tokens (accepted drafts, then the model's own) and rolls back the rest."""
    rows = [(sequence, [context[-1], *drafts]) for sequence, context, drafts in batch]
    mode = Mode.VERIFY if len(batch) == 1 else Mode.VERIFY_BATCH
    starts = [engine.length(sequence) for sequence, _, _ in batch]
    result = engine.step(mode, rows)
    out, first = [], 0
    for (sequence, context, drafts), start, counts in zip(batch, starts, stats):
        predictions = result.tokens[first:first + len(drafts) + 1]
        first += len(drafts) + 1
        kept = accept(drafts, predictions)
        counts.rounds += 1
        counts.proposed += len(drafts)
        counts.accepted += kept
        engine.rollback(sequence, start + 1 + kept)
        out.append([*drafts[:kept], predictions[kept]])
    return out


def speculative_generate(engine: Engine, prompt: Sequence[int], max_new_tokens: int, k: int, *,
                         drafter: Drafter | None = None, stop: Sequence[int] = (),
                         sequence: Hashable = "spec",
                         on_token: Callable[[int], None] | None = None) -> SpeculativeGeneration:
    """Greedy continuation of ``prompt`` with ``k`` drafted tokens per verify step."""
    return speculative_generate_batch(engine, [prompt], max_new_tokens, k, drafter=drafter,
                                      stop=stop, names=[sequence], on_token=on_token)[0]


def speculative_generate_batch(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                               k: int, *, drafter: Drafter | None = None, stop: Sequence[int] = (),
                               names: Sequence[Hashable] | None = None,
                               on_token: Callable[[int], None] | None = None) -> list[SpeculativeGeneration]:
    """Speculative greedy continuations of several prompts; their verify rows share one
    ``verify_batch`` step (one ``verify`` step for a single prompt)."""
    if k < 1:
        raise ValueError(f"speculate needs k >= 1, got {k}")
    drafter = drafter or EarlyExitDrafter()
    names = list(names) if names is not None else [f"spec{i}" for i in range(len(prompts))]
    for name, prompt in zip(names, prompts):
        _check_room(engine, name, prompt, max_new_tokens, slack=k + 1)
    outs = [SpeculativeGeneration(tuple(prompt)) for prompt in prompts]
    contexts = [list(prompt) for prompt in prompts]
    try:
        for name, context, out in zip(names, contexts, outs):
            engine.add_sequence(name)
            started = time.perf_counter()
            first = prefill(engine, name, context, last_only=True).tokens[-1]
            out.timing.prefill_s = time.perf_counter() - started
            if max_new_tokens > 0:
                out.tokens.append(first)
                context.append(first)
                if on_token is not None and len(prompts) == 1:
                    on_token(first)
        started = time.perf_counter()
        while True:
            batch = []
            for i, (name, context, out) in enumerate(zip(names, contexts, outs)):
                if _done(out.tokens, max_new_tokens, stop) or max_new_tokens == 0:
                    continue
                room = min(k, max_new_tokens - len(out.tokens))
                drafts = drafter.propose(engine, name, context, room)[:room] if room > 0 else []
                batch.append((i, name, context, drafts))
            if not batch:
                break
            news = _round(engine, [(name, context, drafts) for _, name, context, drafts in batch],
                          [outs[i].speculation for i, *_ in batch])
            for (i, name, context, _), new in zip(batch, news):
                out = outs[i]
                for token in new:
                    if _done(out.tokens, max_new_tokens, stop):
                        break
                    out.tokens.append(token)
                    out.timing.decode_tokens += 1
                    if on_token is not None and len(prompts) == 1:
                        on_token(token)
                context[len(prompts[i]):] = out.tokens
                # The main cache must hold every committed token but the pending (last) one.
                engine.rollback(name, min(engine.length(name), len(context) - 1))
                drafter.sync(engine, name, context)
        elapsed = time.perf_counter() - started
        for out in outs:
            out.timing.decode_s = elapsed
    finally:
        for name in names:
            engine.free(name)
            drafter.release(engine, name)
    return outs


__all__ = [
    "Drafter", "EarlyExitDrafter", "PromptLookupDrafter", "SpeculationStats",
    "SpeculativeGeneration", "accept", "speculative_generate", "speculative_generate_batch",
]
