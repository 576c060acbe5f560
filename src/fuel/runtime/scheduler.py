"""Continuous batching: which requests run in a step, how many of their tokens, and what each
request receives.

Decides admission, the step's contents and each request's output. One scheduler owns one
:class:`~fuel.runtime.engine.Engine` and is the only caller of its steps (one thread); other
threads only :meth:`Scheduler.submit` and :meth:`Request.cancel`.

A scheduler step, at a step boundary:

1. new submissions join the waiting queue; cancelled requests (waiting or running) leave and
   their KV blocks are freed;
2. waiting requests are admitted in arrival order while the running batch has room
   (``max_batch``) and the KV cache has the blocks their worst case needs (prompt plus
   ``max_tokens``, plus the speculative slack) beyond what running requests have reserved; the
   head of the queue waits rather than being overtaken, so nothing starves;
3. every running request past its prefill feeds one decode row: all of them together in one
   ``multi_seq`` step (``decode`` for a single row), or, with speculation, its pending token
   and its drafts in one ``verify_batch`` step (``verify`` for a single sequence); with
   ``pad_rows`` a multi_seq step is rounded up to a power-of-two row count with scratch rows
   (one token each, rolled back after the step), so ``log2(max_batch)`` programs per block
   width serve every batch size instead of one per size;
4. the rest of the step's token budget (at least one chunk) goes to prompt chunks of the
   requests still prefilling, in arrival order, each a power-of-two ``prefill`` chunk;
5. each row's logits are sampled (:mod:`fuel.runtime.sampling`) and each request gets an
   :class:`Event` with its new tokens and text; a finished request frees its blocks.

Invariants:
- A request whose worst case can never fit (longer than ``max_context`` or than the whole
  cache) is refused at :meth:`~Scheduler.submit` with :class:`RequestTooLarge`; one that fits
  eventually runs. Because admission reserves the worst case, a step never runs out of KV
  blocks; if a step fails anyway, only the requests in that step end (finish ``error``), the
  engine rolls their rows back, and every other sequence's cache is untouched.
- Greedy requests get exactly the tokens they would get alone (batching only changes which
  rows share a step); seeded sampled requests draw only from their own generator.
- After a request ends (finished, cancelled, failed), it holds no block in any section.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from fuel.circuit.ir import Section
from fuel.circuit.rules import Mode
from fuel.errors import FuelError
from fuel.runtime.engine import Engine
from fuel.runtime.generate import DEFAULT_CHUNK, chunks
from fuel.runtime.sampling import (
    SamplerState, SamplingParams, StopMatcher, TokenLogprob, sample, speculative_sample,
)

log = logging.getLogger(__name__)


class RequestTooLarge(FuelError):
    """A request that can never run: ``code`` is OpenAI's error code for it."""

    def __init__(self, detail: str, *, param: str = "messages", code: str = "context_length_exceeded"):
        self.detail, self.param, self.code = detail, param, code
        super().__init__(detail)


class Finish(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Event:
    """What a request receives after a step: new tokens, their visible text, and at the end
    the finish reason and usage."""

    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob | None, ...]
    finish: Finish | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


class Observer(Protocol):
    """Where a scheduler reports timings (the server's metrics)."""

    def first_token(self, seconds: float) -> None: ...

    def inter_token(self, seconds: float) -> None: ...

    def tokens(self, count: int) -> None: ...

    def finished(self, reason: Finish) -> None: ...


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One generation request. ``on_event`` is called from the scheduler's thread."""

    prompt: tuple[int, ...]
    params: SamplingParams
    on_event: Callable[[Event], None]
    id: Hashable = field(default_factory=lambda: f"req{next(_ids)}")
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False

    def cancel(self) -> None:
        """Leave at the next step boundary (safe from any thread)."""
        self.cancelled = True


@dataclass(eq=False)
class _Live:
    request: Request
    state: SamplerState
    reserved: int
    stop: StopMatcher
    fed: int = 0
    tokens: list[int] = field(default_factory=list)
    shown: int = 0
    last_token_at: float | None = None

    @property
    def name(self) -> Hashable:
        return self.request.id

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.request.prompt)

    @property
    def context(self) -> list[int]:
        return [*self.request.prompt, *self.tokens]


@dataclass(frozen=True, slots=True)
class Snapshot:
    waiting: int
    running: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_reserved: int


class Scheduler:
    """Continuous batching over one engine (see the module docstring)."""

    def __init__(self, engine: Engine, tokenizer: Any, *, max_batch: int = 8, token_budget: int = 256,
                 chunk: int = DEFAULT_CHUNK, speculate: int = 0, drafter: Any = None,
                 stop_token_ids: Sequence[int] = (), observer: Observer | None = None,
                 pad_rows: bool = False):
        if max_batch < 1 or token_budget < 1 or chunk < 1 or speculate < 0:
            raise ValueError(f"max_batch {max_batch}, token_budget {token_budget}, chunk {chunk} "
                             f"must be positive and speculate {speculate} not negative")
        if speculate and drafter is None:
            raise ValueError("speculation needs a drafter")
        self.engine, self.tokenizer = engine, tokenizer
        self.max_batch, self.token_budget, self.chunk = max_batch, token_budget, chunk
        self.speculate, self.drafter = speculate, drafter
        self.stop_token_ids = frozenset(stop_token_ids)
        self.observer = observer
        self.pad_rows = pad_rows
        self.vocab = int(engine.weights.config.get("vocab_size") or tokenizer.vocab_size)
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._waiting: list[Request] = []
        self._running: list[_Live] = []
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0

    # -- the public side (any thread) -----------------------------------------------------------

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.engine.block_size)

    def worst_case(self, prompt_tokens: int, max_tokens: int) -> int:
        """Positions a request may occupy: prompt, every new token, and the drafts of a round."""
        return prompt_tokens + max_tokens + self.speculate

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise :class:`RequestTooLarge` if a request of this size can never run."""
        if prompt_tokens < 1:
            raise RequestTooLarge("the prompt is empty", param="prompt", code="invalid_prompt")
        needed = self.worst_case(prompt_tokens, max_tokens)
        if needed > self.engine.max_context:
            raise RequestTooLarge(
                f"this model's maximum context length is {self.engine.max_context} tokens; the "
                f"request needs {needed} ({prompt_tokens} in the prompt, max_tokens {max_tokens}"
                + (f", {self.speculate} speculative" if self.speculate else "")
                + "); shorten the prompt or lower max_tokens")
        usable = self.engine.num_blocks - self.pad_blocks()
        if self.blocks_for(needed) > usable:
            raise RequestTooLarge(
                f"the request needs {self.blocks_for(needed)} KV blocks, the cache has "
                f"{usable}; shorten the prompt or lower max_tokens")

    def submit(self, request: Request) -> None:
        self.check(len(request.prompt), request.params.max_tokens)
        self._inbox.put(request)
        self._wake.set()

    def snapshot(self) -> Snapshot:
        tables = self.engine.tables[Section.MAIN]
        running = list(self._running)
        return Snapshot(waiting=len(self._waiting) + self._inbox.qsize(), running=len(running),
                        kv_blocks_total=tables.num_blocks,
                        kv_blocks_used=tables.num_blocks - tables.free_blocks,
                        kv_blocks_reserved=sum(s.reserved for s in running))

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="fuel-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _loop(self) -> None:
        while not self._stopping:
            try:
                worked = self.step()
            except Exception:  # noqa: BLE001 - the loop must outlive any one step
                log.exception("scheduler step failed")
                worked = False
            if not worked:
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    # -- a step (the scheduler's thread) ----------------------------------------------------------

    def idle(self) -> bool:
        return not self._running and not self._waiting and self._inbox.empty()

    def step(self) -> bool:
        """One step boundary and one step; returns whether anything ran or changed."""
        changed = self._receive()
        changed |= self._reap()
        changed |= self._admit()
        if not self._running:
            return changed
        self.steps += 1
        budget = self.token_budget
        decoding = [s for s in self._running if not s.prefilling]
        if decoding:
            budget -= self._decode(decoding)
        prefilling = [s for s in self._running if s.prefilling]
        for position, live in enumerate(prefilling):
            if position == 0:
                # The oldest prompt always advances, so decode rows never starve admission.
                budget = max(budget, min(self.chunk, self.token_budget))
            elif budget <= 0:
                break
            budget -= self._prefill_chunk(live, budget)
        return True

    def _receive(self) -> bool:
        changed = False
        while True:
            try:
                self._waiting.append(self._inbox.get_nowait())
                changed = True
            except queue.Empty:
                return changed

    def _reap(self) -> bool:
        changed = False
        for request in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(request)
            self._finish_unstarted(request, Finish.CANCELLED)
            changed = True
        for live in [s for s in self._running if s.request.cancelled]:
            self._end(live, Finish.CANCELLED)
            changed = True
        return changed

    def _admit(self) -> bool:
        changed = False
        tables = self.engine.tables[Section.MAIN]
        while self._waiting and len(self._running) < self.max_batch:
            request = self._waiting[0]
            need = self.blocks_for(self.worst_case(len(request.prompt), request.params.max_tokens))
            held = sum(len(tables.blocks(s.name)) for s in self._running if s.name in tables)
            outstanding = sum(s.reserved for s in self._running) - held + self.pad_blocks()
            if need > tables.free_blocks - outstanding:
                break
            self._waiting.pop(0)
            self.engine.add_sequence(request.id)
            self._running.append(_Live(request, SamplerState(request.params, self.vocab), need,
                                       StopMatcher(request.params.stop)))
            changed = True
        return changed

    # -- rows ---------------------------------------------------------------------------------

    def _prefill_chunk(self, live: _Live, budget: int) -> int:
        """Feed the next power-of-two chunk (at most ``budget`` tokens) of a prompt; returns
        its size. The chunk that completes the prompt samples the first new token."""
        prompt = live.request.prompt
        size = chunks(min(len(prompt) - live.fed, max(budget, 1)), self.chunk)[0]
        try:
            result = self.engine.step(Mode.PREFILL, [(live.name, list(prompt[live.fed:live.fed + size]))],
                                      logit_rows=[size - 1])
        except Exception as error:  # noqa: BLE001 - one failed step ends its own requests only
            self._fail([live], error)
            return size
        live.fed += size
        if not live.prefilling:
            sampled = sample(result.logits[-1:], [live.state])
            self._emit(live, sampled.tokens, sampled.logprobs)
        return size

    def _decode(self, decoding: list[_Live]) -> int:
        """One decode (or verify) step for every sequence past its prefill; returns its rows."""
        drafts = [self._drafts(s) for s in decoding] if self.speculate else [[] for _ in decoding]
        rows = [(s.name, [s.tokens[-1], *d]) for s, d in zip(decoding, drafts)]
        count = sum(len(tokens) for _, tokens in rows)
        if count == len(rows):
            mode = Mode.DECODE if len(rows) == 1 else Mode.MULTI_SEQ
        else:
            mode = Mode.VERIFY if len(rows) == 1 else Mode.VERIFY_BATCH
        starts = [self.engine.length(s.name) for s in decoding]
        pads = self._pads(len(rows)) if mode is Mode.MULTI_SEQ else []
        try:
            result = self.engine.step(mode, rows + [(pad, [0]) for pad in pads])
        except Exception as error:  # noqa: BLE001
            self._fail(decoding, error)
            return count
        finally:
            for pad in pads:
                self.engine.free(pad)
        if mode in (Mode.DECODE, Mode.MULTI_SEQ):
            sampled = sample(result.logits, [s.state for s in decoding])
            for live, token, logprob in zip(decoding, sampled.tokens, sampled.logprobs):
                self._emit(live, [token], [logprob])
            return count
        first = 0
        for live, draft, start in zip(decoding, drafts, starts):
            logits = result.logits[first:first + len(draft) + 1]
            first += len(draft) + 1
            tokens, logprobs = speculative_sample(logits, live.state, draft)
            # The cache keeps the pending token and the kept drafts; the last new token is the
            # next pending one.
            self.engine.rollback(live.name, start + len(tokens))
            self._emit(live, tokens, logprobs)
            if live in self._running:
                self.drafter.sync(self.engine, live.name, live.context)
        return count

    def _pads(self, rows: int) -> list[Hashable]:
        """Scratch sequences that round a multi_seq step up to a power-of-two row count (so a
        handful of programs serve every batch size); each holds one token for the step only,
        in a block the admission keeps free for it (freed right after). None when padding is off."""
        if not self.pad_rows:
            return []
        wanted = (1 << (rows - 1).bit_length()) - rows
        pads = []
        for index in range(wanted):
            name = ("pad", index)
            self.engine.add_sequence(name)
            pads.append(name)
        return pads

    def pad_blocks(self) -> int:
        """Blocks admission keeps free for padding rows: the most pads a batch can need."""
        if not self.pad_rows or self.max_batch < 3:
            return 0
        return max((1 << (rows - 1).bit_length()) - rows for rows in range(1, self.max_batch + 1))

    def _drafts(self, live: _Live) -> list[int]:
        room = min(self.speculate, live.request.params.max_tokens - len(live.tokens))
        if room <= 0:
            return []
        try:
            return list(self.drafter.propose(self.engine, live.name, live.context, room))[:room]
        except Exception:  # noqa: BLE001 - a drafter that fails drafts nothing; the row decodes
            log.exception("drafter failed for %r", live.name)
            return []

    # -- output -------------------------------------------------------------------------------

    def _emit(self, live: _Live, tokens: Sequence[int], logprobs: Sequence[TokenLogprob | None]) -> None:
        params = live.request.params
        finish: Finish | None = None
        kept: list[int] = []
        for token in tokens:
            kept.append(token)
            live.tokens.append(token)
            if token in params.stop_token_ids or (token in self.stop_token_ids and not params.ignore_eos):
                finish = Finish.STOP
            elif len(live.tokens) >= params.max_tokens:
                finish = Finish.LENGTH
            if finish is not None:
                break
        live.state.commit(kept)
        text = self.tokenizer.decode(live.tokens, skip_special_tokens=True)
        end, stopped = live.stop.visible(text)
        if stopped:
            finish = Finish.STOP
        elif finish is not None:
            end = len(text)
        new_text, live.shown = text[live.shown:max(end, live.shown)], max(end, live.shown)
        now = time.perf_counter()
        if self.observer is not None:
            if live.last_token_at is None:
                self.observer.first_token(now - live.request.submitted)
            else:
                for _ in kept:
                    self.observer.inter_token((now - live.last_token_at) / len(kept))
            self.observer.tokens(len(kept))
        live.last_token_at = now
        self._send(live.request, Event(new_text, tuple(kept), tuple(logprobs[:len(kept)]), finish,
                                       len(live.request.prompt), len(live.tokens)))
        if finish is not None:
            self._release(live, finish)

    def _send(self, request: Request, event: Event) -> None:
        try:
            request.on_event(event)
        except Exception:  # noqa: BLE001 - a consumer's failure never stops the batch
            log.exception("event consumer of %r failed", request.id)
            request.cancel()

    def _release(self, live: _Live, finish: Finish) -> None:
        self.engine.free(live.name)
        if self.drafter is not None:
            self.drafter.release(self.engine, live.name)
        self._running.remove(live)
        if self.observer is not None:
            self.observer.finished(finish)

    def _end(self, live: _Live, finish: Finish, error: str | None = None) -> None:
        self._send(live.request, Event("", (), (), finish, len(live.request.prompt), len(live.tokens), error))
        self._release(live, finish)

    def _finish_unstarted(self, request: Request, finish: Finish) -> None:
        self._send(request, Event("", (), (), finish, len(request.prompt), 0))
        if self.observer is not None:
            self.observer.finished(finish)

    def _fail(self, lives: Sequence[_Live], error: Exception) -> None:
        log.error("step failed for %s: %s", [s.name for s in lives], error)
        for live in lives:
            if live in self._running:
                self._end(live, Finish.ERROR, f"{type(error).__name__}: {error}")


__all__ = ["Event", "Finish", "Observer", "Request", "RequestTooLarge", "Scheduler", "Snapshot"]
