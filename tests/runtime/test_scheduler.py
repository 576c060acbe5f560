"""The continuous-batching scheduler on the tiny synthetic llama, stepped by hand: batching,
chunked prefill, speculation and admission change no greedy output; a full cache makes
requests wait; a request that can never fit is refused; a failed step or a cancellation ends
only its own requests and leaks no KV block."""

from __future__ import annotations

import random

import pytest

from fuel.circuit.ir import Section
from fuel.circuit.rules import Mode
from fuel.runtime.model import load_model
from fuel.runtime.sampling import SamplingParams
from fuel.runtime.scheduler import Finish, Request, RequestTooLarge, Scheduler
from fuel.runtime.speculative import EarlyExitDrafter, PromptLookupDrafter
from tests.runtime.conftest import write_tiny_gguf

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("scheduler") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture(scope="module")
def model(tiny_path):
    return load_model(tiny_path, max_context=64, max_sequences=8, progress=False)


def prompts(count: int, seed: int = 0, longest: int = 20) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, 12) for _ in range(rng.randrange(1, longest))) for _ in range(count)]


def run(scheduler: Scheduler, requests: list[tuple[tuple[int, ...], SamplingParams]], on_step=None):
    """Submit every request, step until idle; returns each request's events."""
    events: dict[int, list] = {i: [] for i in range(len(requests))}
    handles = []
    for i, (prompt, params) in enumerate(requests):
        handle = Request(prompt, params, events[i].append)
        scheduler.submit(handle)
        handles.append(handle)
    while not scheduler.idle():
        scheduler.step()
        if on_step is not None:
            on_step(scheduler, handles, events)
    return [events[i] for i in range(len(requests))]


def tokens_of(events) -> list[int]:
    return [t for e in events for t in e.tokens]


def all_free(engine) -> bool:
    return all(tables.free_blocks == tables.num_blocks and not tables.sequences()
               for tables in engine.tables.values())


@pytest.fixture(scope="module")
def alone(model):
    scheduler = Scheduler(model.engine, model.tokenizer, max_batch=1)
    return {p: tokens_of(run(scheduler, [(p, GREEDY)])[0]) for p in prompts(6)}


def test_batched_greedy_outputs_equal_each_prompt_alone(model, alone):
    scheduler = Scheduler(model.engine, model.tokenizer, max_batch=8, token_budget=16)
    before = model.engine.stats.steps[Mode.MULTI_SEQ.value]
    outs = run(scheduler, [(p, GREEDY) for p in alone])
    assert [tokens_of(e) for e in outs] == list(alone.values())
    assert all(e[-1].finish is Finish.LENGTH and e[-1].completion_tokens == 12 for e in outs)
    assert model.engine.stats.steps[Mode.MULTI_SEQ.value] > before
    assert all_free(model.engine)


def test_padded_decode_rows_are_powers_of_two_and_change_no_output(model, alone, monkeypatch):
    real, rows = model.engine.step, []

    def recording(mode, batch, **kw):
        if mode is Mode.MULTI_SEQ:
            rows.append(len(batch))
        return real(mode, batch, **kw)

    monkeypatch.setattr(model.engine, "step", recording)
    scheduler = Scheduler(model.engine, model.tokenizer, max_batch=6, token_budget=16, pad_rows=True)
    outs = run(scheduler, [(p, GREEDY) for p in alone])
    assert [tokens_of(e) for e in outs] == list(alone.values())
    assert rows and all(n & (n - 1) == 0 for n in rows) and 8 in rows
    assert all_free(model.engine)


def test_decode_rows_keep_advancing_while_a_long_prompt_is_prefilled_in_chunks(model):
    scheduler = Scheduler(model.engine, model.tokenizer, max_batch=4, token_budget=4, chunk=4)
    short, long = (3, 4), tuple(random.Random(1).randrange(3, 12) for _ in range(40))
    seen = []

    def watch(s, handles, events):
        running = {live.request.id: live for live in s._running}
        if handles[1].id in running and running[handles[1].id].prefilling and handles[0].id in running:
            seen.append(len(events[0]))

    outs = run(scheduler, [(short, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)),
                           (long, GREEDY)], on_step=watch)
    # The long prompt took several steps (4 tokens each), and the short request got a token in
    # every one of them.
    assert len(seen) >= 5 and seen == list(range(seen[0], seen[0] + len(seen)))
    alone = Scheduler(model.engine, model.tokenizer, max_batch=1)
    assert tokens_of(outs[1]) == tokens_of(run(alone, [(long, GREEDY)])[0])


def test_a_full_cache_makes_requests_wait_and_every_one_finishes(tiny_path, alone):
    # 2 sequences of 64 positions = 8 blocks of 16; each request reserves the blocks of its
    # prompt plus 30 tokens (3 or 4), so at most 2 of the 8 allowed run at once.
    small = load_model(tiny_path, max_context=64, max_sequences=2, progress=False)
    scheduler = Scheduler(small.engine, small.tokenizer, max_batch=8, token_budget=64)
    big = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    peak = []

    def watch(s, handles, events):
        snap = s.snapshot()
        peak.append(snap.running)
        assert snap.kv_blocks_used <= snap.kv_blocks_reserved <= snap.kv_blocks_total

    requests = [(p, big) for p in list(alone)[:3]] * 2
    outs = run(scheduler, requests, on_step=watch)
    assert max(peak) == 2  # admission on KV blocks, not max_batch, bounded the batch
    assert all(e[-1].finish is Finish.LENGTH and len(tokens_of(e)) == 30 for e in outs)
    assert [tokens_of(e) for e in outs[:3]] == [tokens_of(e) for e in outs[3:]]
    assert [tokens_of(e)[:12] for e in outs[:3]] == list(alone.values())[:3]
    assert all_free(small.engine)


def test_a_request_that_can_never_fit_is_refused_at_submission(model):
    scheduler = Scheduler(model.engine, model.tokenizer, max_batch=2)
    with pytest.raises(RequestTooLarge) as refused:
        scheduler.submit(Request(tuple([3] * 60), SamplingParams(max_tokens=8), lambda e: None))
    assert refused.value.code == "context_length_exceeded" and "64" in str(refused.value)
    with pytest.raises(RequestTooLarge):
        scheduler.submit(Request((), SamplingParams(), lambda e: None))
    assert scheduler.idle()


def test_a_failed_step_ends_only_its_requests_and_corrupts_no_other(model, alone, monkeypatch):
    engine = model.engine
    scheduler = Scheduler(engine, model.tokenizer, max_batch=8, token_budget=64)
    victim = list(alone)[3]
    real = engine.step
    events = {i: [] for i in range(len(alone))}
    requests = [Request(p, GREEDY, events[i].append) for i, p in enumerate(alone)]
    victim_id = requests[3].id

    def failing(mode, batch, **kw):
        if mode is Mode.PREFILL and batch[0][0] == victim_id:
            raise RuntimeError("injected fault")
        return real(mode, batch, **kw)

    monkeypatch.setattr(engine, "step", failing)
    for request in requests:
        scheduler.submit(request)
    while not scheduler.idle():
        scheduler.step()
    for i, (p, expected) in enumerate(alone.items()):
        if p == victim:
            assert events[i][-1].finish is Finish.ERROR and "injected fault" in events[i][-1].error
        else:
            assert tokens_of(events[i]) == expected
    assert all_free(engine)


def test_a_cancelled_request_frees_its_blocks_at_the_next_step(model):
    scheduler = Scheduler(model.engine, model.tokenizer, max_batch=4)
    events = []
    request = Request((3, 4, 5), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), events.append)
    scheduler.submit(request)
    for _ in range(3):
        scheduler.step()
    assert scheduler.snapshot().kv_blocks_used > 0
    request.cancel()
    scheduler.step()
    assert events[-1].finish is Finish.CANCELLED and scheduler.idle()
    assert all_free(model.engine)


@pytest.mark.parametrize("drafter", [PromptLookupDrafter(), EarlyExitDrafter()], ids=["prompt-lookup", "early-exit"])
def test_speculative_greedy_rows_equal_plain_greedy(model, alone, drafter):
    scheduler = Scheduler(model.engine, model.tokenizer, max_batch=8, speculate=3, drafter=drafter)
    before = model.engine.stats.steps[Mode.VERIFY_BATCH.value]
    outs = run(scheduler, [(p, GREEDY) for p in alone])
    assert [tokens_of(e) for e in outs] == list(alone.values())
    assert model.engine.stats.steps[Mode.VERIFY_BATCH.value] > before
    assert all_free(model.engine) and not model.engine.tables[Section.DRAFT].sequences()


def test_seeded_sampled_requests_reproduce_with_and_without_partners(model, alone):
    sampled = SamplingParams(temperature=1.0, top_k=5, seed=42, max_tokens=10, ignore_eos=True)
    batch = [(p, sampled) for p in list(alone)[:3]]
    first = run(Scheduler(model.engine, model.tokenizer, max_batch=4), batch)
    solo = run(Scheduler(model.engine, model.tokenizer, max_batch=4), batch[:1])
    assert tokens_of(first[0]) == tokens_of(solo[0])
    assert tokens_of(first[0]) != list(alone.values())[0][:10]  # it did sample

    def speculative():
        scheduler = Scheduler(model.engine, model.tokenizer, max_batch=4, speculate=2, drafter=PromptLookupDrafter())
        return [tokens_of(e) for e in run(scheduler, batch)]

    again = speculative()
    assert again == speculative() and all(len(t) == 10 for t in again)
