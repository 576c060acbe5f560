"""fuel serve end to end: one server per module on a free loopback port, over the tiny synthetic
llama (a ChatML template, 12-token vocabulary), driven by the official openai client (sync
and async, streaming and not) and by raw HTTP for malformed bodies."""

from __future__ import annotations

import asyncio
import random
import re
import time

import httpx
import openai
import pytest

from fuel.runtime.generate import generate
from fuel.runtime.model import load_model
from fuel.serve import BackgroundServer, ServeOptions
from tests.runtime.conftest import write_tiny_gguf

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
KEY = "test-key"
MODEL = "tiny"
CONTEXT = 512


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "tiny-chat.gguf"
    write_tiny_gguf(path, chat_template=CHATML)
    return path


@pytest.fixture(scope="module")
def server(tiny_path):
    model = load_model(tiny_path, max_context=CONTEXT, max_sequences=16, progress=False)
    options = ServeOptions(max_batch=16, token_budget=24, api_key=KEY, model_name=MODEL)
    with BackgroundServer(model, options) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_path):
    """A second engine on the same weights: what `fuel run` would generate, greedily."""
    return load_model(tiny_path, max_context=CONTEXT, max_sequences=1, progress=False)


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def finished(server, reason: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return metric(server, f'fuel_requests_total{{finish="{reason}"}}') if f'finish="{reason}"' in text else 0.0


def prompts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["a", "b", "c", "ab", "1", "2", "12"]
    return [" ".join(rng.choice(words) for _ in range(rng.randrange(1, 12))) for _ in range(count)]


def test_greedy_completion_equals_the_engines_greedy_generation(client, reference):
    prompt = "ab a 12 c"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    tokens = generate(reference.engine, reference.tokenizer.encode(prompt), 12).tokens
    assert out.choices[0].text == reference.tokenizer.decode(tokens, skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(reference.tokenizer.encode(prompt))
    assert out.usage.completion_tokens == len(tokens)
    assert out.choices[0].finish_reason == "length" and len(tokens) == 12


def test_16_concurrent_greedy_requests_equal_the_same_prompts_run_alone(server, client):
    texts = prompts(16)
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
             for p in texts]

    async def together():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as aclient:
            outs = await asyncio.gather(*[
                aclient.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True})
                for p in texts])
        return [o.choices[0].text for o in outs]

    steps = server.scheduler.steps
    assert asyncio.run(together()) == alone
    # They really shared steps: far fewer scheduler steps than 16 prompts' worth of tokens.
    assert server.scheduler.steps - steps < 16 * 16 / 2


def test_streamed_chat_chunks_add_up_to_the_non_streamed_answer(client):
    messages = [{"role": "user", "content": "ab 12 c"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=14, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=14, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_async_streamed_completion_equals_the_sync_one(server, client):
    sync = client.completions.create(model=MODEL, prompt="c c ab", max_tokens=10, temperature=0).choices[0].text

    async def streamed():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as aclient:
            stream = await aclient.completions.create(model=MODEL, prompt="c c ab", max_tokens=10,
                                                      temperature=0, stream=True)
            return "".join([chunk.choices[0].text async for chunk in stream])

    assert asyncio.run(streamed()) == sync


def test_seeded_sampling_reproduces_and_another_seed_differs(client):
    def run(seed):
        return [client.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=1.0, top_p=0.95,
                                          seed=seed, extra_body={"ignore_eos": True}).choices[0].text
                for p in prompts(3, seed=5)]

    first = run(1234)
    assert run(1234) == first
    assert run(99) != first


def test_cancelled_streams_give_their_kv_blocks_back(server, client):
    before = finished(server, "cancelled")
    streams = [client.completions.create(model=MODEL, prompt=p, max_tokens=CONTEXT - 32, temperature=0.7,
                                         extra_body={"ignore_eos": True}, stream=True)
               for p in prompts(4, seed=9)]
    for stream in streams:
        next(iter(stream))
    assert metric(server, "fuel_kv_blocks_used") > 0
    for stream in streams:
        stream.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (metric(server, "fuel_kv_blocks_used") > 0
                                           or metric(server, "fuel_running_sequences") > 0):
        time.sleep(0.05)
    assert metric(server, "fuel_kv_blocks_used") == 0
    assert metric(server, "fuel_kv_blocks_free") == metric(server, "fuel_kv_blocks_total")
    assert metric(server, "fuel_running_sequences") == 0
    assert finished(server, "cancelled") == before + 4


def test_a_prompt_longer_than_the_context_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="ab " * CONTEXT, max_tokens=4)
    assert refused.value.status_code == 400
    assert refused.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="ab", max_tokens=CONTEXT)


def test_stop_strings_end_the_text_before_the_stop(client):
    fixed = {"ignore_eos": True}
    free = client.completions.create(model=MODEL, prompt="ab a 12 c", max_tokens=12, temperature=0,
                                     extra_body=fixed).choices[0]
    assert len(free.text) >= 4, free.text
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 2]
    stopped = client.completions.create(model=MODEL, prompt="ab a 12 c", max_tokens=12, temperature=0,
                                        stop=[stop], extra_body=fixed).choices[0]
    assert stopped.text == free.text[:free.text.index(stop)]
    assert stopped.finish_reason == "stop"


def test_logprobs_list_the_chosen_token_and_the_top_n(client):
    out = client.completions.create(model=MODEL, prompt="ab a", max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    for lp, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) <= 3 and lp <= 0
        assert lp == pytest.approx(max(top.values()))  # greedy: the chosen token is the best one
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    entries = chat.choices[0].logprobs.content
    assert entries and all(len(e.top_logprobs) == 2 for e in entries)


def test_models_health_and_metrics_routes(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("fuel_queue_length", "fuel_running_sequences", "fuel_kv_blocks_used", "fuel_kv_blocks_free",
                 "fuel_generation_tokens_per_second", "fuel_time_to_first_token_seconds_bucket",
                 "fuel_inter_token_latency_seconds_bucket", "fuel_program_builds"):
        assert name in text
    assert metric(server, "fuel_generation_tokens_total") > 0


def test_every_route_but_health_needs_the_api_key(server):
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions")):
        refused = httpx.request(method, f"{server.url}{path}", json={"model": MODEL, "prompt": "a"},
                                headers={"Authorization": "Bearer wrong"})
        assert refused.status_code == 401, path
        assert refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200


MALFORMED = [
    (b"{", "invalid_json", None),
    (b"[1, 2]", None, None),
    (b'{"model": "tiny"}', None, "prompt"),
    (b'{"model": "tiny", "prompt": "a", "max_tokens": "many"}', None, "max_tokens"),
    (b'{"model": "tiny", "prompt": "a", "temperature": 5}', None, "temperature"),
    (b'{"model": "tiny", "prompt": "a", "top_p": 0}', None, "top_p"),
    (b'{"model": "tiny", "prompt": "a", "max_tokens": 0}', None, "max_tokens"),
    (b'{"model": "tiny", "prompt": "a", "n": 2}', None, "n"),
    (b'{"model": "tiny", "prompt": "a", "echo": true}', None, "echo"),
    (b'{"model": "tiny", "prompt": [999]}', None, "prompt"),
    (b'{"model": "tiny", "prompt": ["a", "b"]}', None, "prompt"),
    (b'{"model": "tiny", "prompt": ""}', "invalid_prompt", "prompt"),
    (b'{"model": "tiny", "prompt": "a", "logprobs": 50}', None, "logprobs"),
    # JSON allows a lone surrogate escape; it is no character, so no tokenizer takes it
    (b'{"model": "tiny", "prompt": "a\\ud800b"}', None, "prompt"),
    (b'{"model": "tiny", "prompt": ["\\udfff"]}', None, "prompt"),
    (b'{"model": "tiny", "prompt": "a", "stop": ["\\udc00"]}', None, "stop"),
]


@pytest.mark.parametrize("body, code, param", MALFORMED)
def test_malformed_completion_bodies_get_an_openai_400(server, body, code, param):
    answer = httpx.post(f"{server.url}/v1/completions", content=body,
                        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert "Traceback" not in answer.text
    if code:
        assert error["code"] == code
    if param:
        assert error["param"] == param


@pytest.mark.parametrize("body, status", [
    (b'{"model": "tiny", "messages": []}', 400),
    (b'{"model": "tiny", "messages": [{"role": "wizard", "content": "a"}]}', 400),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}', 400),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}', 400),
    (b'{"model": "other", "messages": [{"role": "user", "content": "a"}]}', 404),
])
def test_malformed_chat_bodies_get_an_openai_4xx(server, body, status):
    answer = httpx.post(f"{server.url}/v1/chat/completions", content=body,
                        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["message"]


def test_unknown_routes_and_methods_are_openai_errors_not_500(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{server.url}/v1/nothing", headers=headers).status_code == 404
    wrong = httpx.get(f"{server.url}/v1/completions", headers=headers)
    assert wrong.status_code == 405 and wrong.json()["error"]["message"]
