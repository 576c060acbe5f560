"""Sampling: turning a step's logits into tokens, per request, for every row of a step at once.

Decides how a request's sampling parameters (temperature, top-k, top-p, min-p, presence and
frequency penalties, seed, logprobs, stop strings and ids, max_tokens) pick its next token, and
how speculative drafts are accepted under sampling (rejection sampling).

Each step's rows are processed together as tensors ``[rows, vocab]``; the only Python loops
run over rows (one uniform draw per row from that request's own ``torch.Generator``), never
over the vocabulary.

Order of the transforms, per row: penalties on the raw logits (``logit - frequency * count -
presence * [count > 0]`` over the tokens generated so far) -> temperature -> top-k -> top-p on
the top-k-renormalized distribution (the smallest prefix, by probability, whose mass reaches
``top_p``) -> min-p (tokens below ``min_p`` times the most likely one) -> renormalize -> one
inverse-CDF draw. Logprobs are the model's own (``log_softmax`` of the raw logits).

Invariants:
- Temperature 0 is greedy: the argmax of the (penalized) logits, no random draw; with no
  penalties it is exactly the engine's greedy token.
- A request's draws come only from its own generator (seeded from ``seed`` when given), so a
  seeded request's tokens do not depend on what else shares its steps.
- The most likely token always survives the filters (a row never has an empty distribution).
- :func:`speculative_accept` emits tokens distributed exactly as sampling from the target
  distribution one token at a time (Leviathan et al. 2023, "Fast Inference from Transformers
  via Speculative Decoding", Algorithm 1): draft ``d_i`` is kept with probability
  ``min(1, p(d_i) / q(d_i))``; on the first rejection a token is drawn from
  ``norm(max(0, p - q))``; when every draft is kept, one more is drawn from the next target.
  A drafter that proposes deterministically (greedy early-exit, prompt lookup) has point-mass
  ``q``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fuel.errors import FuelError

if TYPE_CHECKING:
    import torch

MAX_LOGPROBS = 20


class InvalidSampling(FuelError):
    """A sampling parameter outside its range; ``param`` is the OpenAI request field name."""

    def __init__(self, param: str, value: object, detail: str):
        self.param, self.value, self.detail = param, value, detail
        super().__init__(f"`{param}` = {value!r}: {detail}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """One request's sampling parameters (OpenAI's names and ranges; top_k and min_p as vLLM)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) keeps every token."""
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    """Top alternatives to report per token (0: the chosen token's logprob only); None: none."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence token (fixed-length load tests)."""

    def __post_init__(self) -> None:
        def check(param: str, value: float, ok: bool, detail: str) -> None:
            if not ok:
                raise InvalidSampling(param, value, detail)

        finite = lambda v: v == v and abs(v) != float("inf")  # noqa: E731
        check("temperature", self.temperature, finite(self.temperature) and 0 <= self.temperature <= 2,
              "must be between 0 and 2 (0 is greedy)")
        check("top_p", self.top_p, finite(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]")
        check("top_k", self.top_k, self.top_k >= -1, "must be -1 or 0 (off) or a positive count")
        check("min_p", self.min_p, finite(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1]")
        for param in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, param)
            check(param, value, finite(value) and -2 <= value <= 2, "must be between -2 and 2")
        check("max_tokens", self.max_tokens, self.max_tokens >= 1, "must be at least 1")
        if self.logprobs is not None:
            check("logprobs", self.logprobs, 0 <= self.logprobs <= MAX_LOGPROBS,
                  f"must be between 0 and {MAX_LOGPROBS}")
        if any(not s for s in self.stop):
            raise InvalidSampling("stop", list(self.stop), "stop strings must not be empty")
        if len(self.stop) > 4:
            raise InvalidSampling("stop", list(self.stop), "at most 4 stop strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0


@dataclass(slots=True)
class SamplerState:
    """A request's sampling state across steps: its parameters, generator and token counts."""

    params: SamplingParams
    vocab: int
    generator: torch.Generator = field(init=False)
    counts: torch.Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        import torch

        self.generator = torch.Generator()
        # Unseeded requests still get their own generator (seeded from the process's entropy),
        # so no two requests share a random stream.
        seed = self.params.seed if self.params.seed is not None else random.SystemRandom().getrandbits(63)
        self.generator.manual_seed(seed % (1 << 63))
        if self.params.penalized:
            self.counts = torch.zeros(self.vocab, dtype=torch.float32)

    def commit(self, tokens: Sequence[int]) -> None:
        """``tokens`` were emitted: count them for the penalties."""
        if self.counts is not None:
            for token in tokens:
                self.counts[token] += 1

    def uniforms(self, count: int) -> torch.Tensor:
        import torch

        return torch.rand(count, generator=self.generator, dtype=torch.float64)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The chosen token's logprob and the ``n`` most likely tokens' (model's raw distribution)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def _row_params(states: Sequence[SamplerState]):
    import torch

    def column(name: str, dtype=torch.float32):
        return torch.tensor([getattr(s.params, name) for s in states], dtype=dtype)

    temperature = column("temperature")
    top_k = torch.tensor([max(s.params.top_k, 0) for s in states], dtype=torch.int64)
    return temperature, top_k, column("top_p"), column("min_p")


def penalize(logits: torch.Tensor, states: Sequence[SamplerState],
             counts: torch.Tensor | None = None) -> torch.Tensor:
    """``logits`` [rows, vocab] (float32) less each row's presence/frequency penalty; ``counts``
    overrides the states' counts (speculative rows: counts including the drafts before them)."""
    import torch

    if counts is None:
        if not any(s.counts is not None for s in states):
            return logits
        counts = torch.stack([s.counts if s.counts is not None else torch.zeros(logits.shape[-1])
                              for s in states])
    presence = torch.tensor([s.params.presence_penalty for s in states], dtype=torch.float32)[:, None]
    frequency = torch.tensor([s.params.frequency_penalty for s in states], dtype=torch.float32)[:, None]
    return logits - frequency * counts - presence * (counts > 0).to(torch.float32)


def distributions(logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """Each row's sampling distribution ``[rows, vocab]`` from its (penalized) logits: one-hot
    at the argmax for greedy rows, else temperature, top-k, top-p and min-p, renormalized."""
    import torch

    rows, vocab = logits.shape
    temperature, top_k, top_p, min_p = _row_params(states)
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    ordered, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    probs = torch.softmax(ordered, dim=-1)
    ranks = torch.arange(vocab)[None, :]
    keep = (top_k[:, None] == 0) | (ranks < top_k[:, None])
    probs = probs * keep
    probs = probs / probs.sum(-1, keepdim=True)
    before = probs.cumsum(-1) - probs
    keep &= (before < top_p[:, None]) | (top_p[:, None] >= 1)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    keep[:, 0] = True
    keep &= ~greedy[:, None] | (ranks == 0)
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, probs)


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row: ``uniforms`` [rows] in [0, 1) -> token ids [rows]. A token of
    probability 0 is never drawn."""
    import torch

    cdf = probs.to(torch.float64).cumsum(-1)
    target = (uniforms.to(torch.float64) * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return index.clamp_(max=probs.shape[-1] - 1)


def logprobs_of(logits: torch.Tensor, tokens: Sequence[int],
                states: Sequence[SamplerState]) -> list[TokenLogprob | None]:
    """The chosen tokens' logprobs (and top-n) for the rows whose request asked for them."""
    import torch

    wanted = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(states)
    if not wanted:
        return out
    logp = torch.log_softmax(logits[wanted].to(torch.float32), dim=-1)
    most = max(states[i].params.logprobs for i in wanted)
    top_values, top_ids = logp.topk(max(most, 1), dim=-1)
    for row, i in enumerate(wanted):
        n = states[i].params.logprobs
        top = tuple(zip(top_ids[row, :n].tolist(), top_values[row, :n].tolist()))
        out[i] = TokenLogprob(tokens[i], float(logp[row, tokens[i]]), top)
    return out


@dataclass(frozen=True, slots=True)
class Sampled:
    tokens: list[int]
    logprobs: list[TokenLogprob | None]


def sample(logits: torch.Tensor, states: Sequence[SamplerState]) -> Sampled:
    """One token per row of ``logits`` [rows, vocab], row ``i`` sampled for ``states[i]``."""
    import torch

    raw = logits.to(torch.float32)
    penalized = penalize(raw, states)
    tokens = penalized.argmax(-1)
    sampled = [i for i, s in enumerate(states) if not s.params.greedy]
    if sampled:
        probs = distributions(penalized[sampled], [states[i] for i in sampled])
        uniforms = torch.cat([states[i].uniforms(1) for i in sampled])
        tokens[sampled] = draw(probs, uniforms)
    ids = tokens.tolist()
    return Sampled(ids, logprobs_of(raw, ids, states))


def speculative_accept(target: torch.Tensor, drafts: Sequence[int], uniforms: torch.Tensor,
                       residual_uniform: torch.Tensor, draft_probs: torch.Tensor | None = None) -> list[int]:
    """Rejection sampling of ``drafts`` (k tokens) against the target distributions ``target``
    [k + 1, vocab] (row ``i``: the target's distribution for position ``i``, given the drafts
    before it); ``draft_probs`` [k, vocab] the drafter's distributions (None: point masses at
    the drafts). ``uniforms`` [k] decide acceptance, ``residual_uniform`` [1] the last token.
    Returns the kept drafts followed by one token from the target (or the residual)."""
    import torch

    k = len(drafts)
    index = torch.tensor(list(drafts), dtype=torch.int64)
    positions = torch.arange(k)
    p = target[positions, index].to(torch.float64)
    q = torch.ones(k, dtype=torch.float64) if draft_probs is None else draft_probs[positions, index].to(torch.float64)
    rejected = (uniforms.to(torch.float64) * q >= p).nonzero()
    kept = int(rejected[0, 0]) if len(rejected) else k
    if kept == k:
        last = target[k]
    else:
        proposal = (torch.nn.functional.one_hot(index[kept], target.shape[-1]).to(target.dtype)
                    if draft_probs is None else draft_probs[kept])
        residual = (target[kept] - proposal).clamp_(min=0)
        # A rejection implies p(d) < q(d), so mass is left elsewhere; guard float dust anyway.
        last = residual if float(residual.sum()) > 0 else target[kept]
    token = int(draw(last[None, :], residual_uniform)[0])
    return [*drafts[:kept], token]


def draft_counts(state: SamplerState, drafts: Sequence[int]) -> torch.Tensor | None:
    """Counts ``[k + 1, vocab]`` for a speculative row's positions: the request's counts plus
    the drafts before each position (None when the request has no penalties)."""
    import torch

    if state.counts is None:
        return None
    steps = torch.zeros(len(drafts) + 1, state.vocab, dtype=torch.float32)
    if drafts:
        steps[torch.arange(1, len(drafts) + 1), torch.tensor(list(drafts))] = 1
    return state.counts[None, :] + steps.cumsum(0)


def speculative_sample(logits: torch.Tensor, state: SamplerState, drafts: Sequence[int]) -> tuple[list[int], list[TokenLogprob | None]]:
    """A verify row group's new tokens: ``logits`` [k + 1, vocab] for the pending token and the
    ``k`` drafts. Greedy requests keep the drafts equal to the argmax (plain greedy output);
    sampled ones go through :func:`speculative_accept`. Returns the tokens and their logprobs."""
    import torch

    raw = logits.to(torch.float32)
    rows = [state] * (len(drafts) + 1)
    penalized = penalize(raw, rows, draft_counts(state, drafts))
    if state.params.greedy:
        predictions = penalized.argmax(-1).tolist()
        kept = 0
        while kept < len(drafts) and drafts[kept] == predictions[kept]:
            kept += 1
        tokens = [*drafts[:kept], predictions[kept]]
    else:
        target = distributions(penalized, rows)
        tokens = speculative_accept(target, drafts, state.uniforms(len(drafts)), state.uniforms(1))
    return tokens, logprobs_of(raw[:len(tokens)], tokens, rows[:len(tokens)])


class StopMatcher:
    """Stop strings over a growing text: where the visible text ends, and whether it stopped.

    Text that could still be the start of a stop string is held back (not yet visible); the
    stop string itself is never visible.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)

    def visible(self, text: str) -> tuple[int, bool]:
        """``(end, stopped)``: ``text[:end]`` may be shown; ``stopped`` when a stop string occurs."""
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            return min(found), True
        hold = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:size]):
                    hold = size
                    break
        # An incomplete UTF-8 character decodes as U+FFFD until its last byte arrives.
        end = len(text) - hold
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        return end, False


__all__ = [
    "InvalidSampling", "MAX_LOGPROBS", "Sampled", "SamplerState", "SamplingParams", "StopMatcher",
    "TokenLogprob", "distributions", "draft_counts", "draw", "logprobs_of", "penalize", "sample",
    "speculative_accept", "speculative_sample",
]
