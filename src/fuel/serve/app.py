"""The OpenAI-compatible HTTP API over a :class:`~fuel.runtime.scheduler.Scheduler`.

Decides the routes, the response bodies (OpenAI's ``text_completion``, ``chat.completion`` and
their streaming chunks as server-sent events ending in ``data: [DONE]``), authentication and
every error's status and body.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics`` (Prometheus text).

Invariants:
- Every error is OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``. A
  bad request (malformed JSON, a wrong type, a value out of range, an unsupported field, a
  prompt that can never fit, an unknown model) is a 4xx; only a fault of fuel's own is a 500,
  and its body carries no traceback.
- With an API key, every route but ``/health`` needs ``Authorization: Bearer KEY`` (401 else).
- A streaming client that goes away cancels its request: the scheduler frees its KV blocks at
  the next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from fuel.errors import FuelError
from fuel.runtime.sampling import InvalidSampling, SamplingParams, TokenLogprob
from fuel.runtime.scheduler import Event, Finish, Request, RequestTooLarge, Scheduler
from fuel.runtime.tokenizer import ChatTemplateError
from fuel.serve.metrics import Metrics
from fuel.serve.protocol import ChatCompletionRequest, CompletionRequest, Unsupported


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model_name: str
    api_key: str | None = None
    default_max_tokens: int = 256
    """max_tokens of a chat request that names none (capped by the room left in the context)."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _error(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status)


def create_app(scheduler: Scheduler, tokenizer: Any, metrics: Metrics, config: ServeConfig) -> FastAPI:
    """The app; its lifespan starts and stops the scheduler's thread."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="fuel serve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    metrics.bind(scheduler)

    async def authorized(request: HttpRequest) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip(), config.api_key):
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                           code="invalid_api_key")

    # -- errors ---------------------------------------------------------------------------------

    @app.exception_handler(ApiError)
    async def api_error(_: HttpRequest, error: ApiError):
        return _error(error.status, error.message, error.type, error.param, error.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: HttpRequest, error: RequestValidationError):
        problems = error.errors()
        first = problems[0] if problems else {"loc": (), "msg": "invalid request"}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            return _error(400, f"the body is not valid JSON: {first.get('msg')}", param=None,
                          code="invalid_json")
        param = ".".join(loc) or None
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return _error(400, f"`{param}`: {first.get('msg')}{more}" if param else f"{first.get('msg')}{more}",
                      param=param)

    @app.exception_handler(HTTPException)
    async def http_error(_: HttpRequest, error: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return _error(error.status_code, str(error.detail), code=code)

    @app.exception_handler(Exception)
    async def internal(_: HttpRequest, error: Exception):
        return _error(500, f"internal error in fuel serve ({type(error).__name__})", "server_error")

    def refusal(error: Exception) -> ApiError:
        if isinstance(error, InvalidSampling):
            return ApiError(400, str(error), param=error.param)
        if isinstance(error, Unsupported):
            return ApiError(400, error.detail, param=error.param)
        if isinstance(error, RequestTooLarge):
            return ApiError(400, error.detail, param=error.param, code=error.code)
        if isinstance(error, ChatTemplateError):
            return ApiError(400, f"{error.detail}; use /v1/completions with a plain prompt",
                            param="messages")
        return ApiError(400, str(error))

    # -- routes ---------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def metrics_route():
        return Response(metrics.render(), media_type=metrics.content_type)

    def model_card() -> dict:
        return {"id": config.model_name, "object": "model", "created": 0, "owned_by": "fuel"}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}", dependencies=[Depends(authorized)])
    async def model(name: str):
        check_model(name)
        return model_card()

    def check_model(name: str) -> None:
        if name != config.model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves "
                                f"{config.model_name!r}", param="model", code="model_not_found")

    def default_max_tokens(prompt_tokens: int) -> int:
        room = scheduler.engine.max_context - prompt_tokens - scheduler.speculate
        return max(1, min(config.default_max_tokens, room))

    def start(prompt: list[int], params: SamplingParams, param: str) -> tuple[Request, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        request = Request(tuple(prompt), params, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        try:
            scheduler.submit(request)
        except RequestTooLarge as error:
            raise ApiError(400, error.detail, param=param, code=error.code) from None
        metrics.prompt.inc(len(prompt))
        return request, events

    async def collect(request: Request, events: asyncio.Queue) -> list[Event]:
        out: list[Event] = []
        try:
            while True:
                event = await events.get()
                out.append(event)
                if event.finish is not None:
                    return out
        except asyncio.CancelledError:
            request.cancel()
            raise

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest):
        check_model(body.model)
        try:
            body.checked()
            prompt = body.prompt_input()
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            check_ids(ids)
            max_tokens = body.max_tokens if body.max_tokens is not None else default_max_tokens(len(ids))
            params = body.sampling(max_tokens, body.logprobs)
        except (FuelError, Unsupported) as error:
            raise refusal(error) from None
        request, events = start(ids, params, "prompt")
        name, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())
        if body.stream:
            return sse(stream_completion(request, events, name, created, body.include_usage), request)
        done = await collect(request, events)
        failed(done)
        tokens = [lp for e in done for lp in e.logprobs]
        choice = {"index": 0, "text": "".join(e.text for e in done),
                  "logprobs": completion_logprobs(tokens) if params.logprobs is not None else None,
                  "finish_reason": done[-1].finish.value}
        return {"id": name, "object": "text_completion", "created": created, "model": config.model_name,
                "choices": [choice], "usage": usage(done[-1])}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(body: ChatCompletionRequest):
        check_model(body.model)
        try:
            ids = tokenizer.encode(tokenizer.apply_chat_template(body.message_dicts()))
            limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            params = body.sampling(limit if limit is not None else default_max_tokens(len(ids)),
                                   body.logprob_count())
        except (FuelError, Unsupported) as error:
            raise refusal(error) from None
        request, events = start(ids, params, "messages")
        name, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        if body.stream:
            return sse(stream_chat(request, events, name, created, body.include_usage,
                                   params.logprobs is not None), request)
        done = await collect(request, events)
        failed(done)
        tokens = [lp for e in done for lp in e.logprobs]
        choice = {"index": 0,
                  "message": {"role": "assistant", "content": "".join(e.text for e in done)},
                  "logprobs": chat_logprobs(tokens) if params.logprobs is not None else None,
                  "finish_reason": done[-1].finish.value}
        return {"id": name, "object": "chat.completion", "created": created, "model": config.model_name,
                "choices": [choice], "usage": usage(done[-1])}

    # -- bodies ---------------------------------------------------------------------------------

    vocab = scheduler.vocab

    def check_ids(ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise Unsupported("prompt", f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")

    def failed(done: list[Event]) -> None:
        if done[-1].finish is Finish.ERROR:
            raise ApiError(500, f"generation failed: {done[-1].error}", type="server_error")

    def piece(token: int) -> str:
        return tokenizer.decode([token])

    def completion_logprobs(tokens: list[TokenLogprob | None]) -> dict:
        entries = [t for t in tokens if t is not None]
        texts = [piece(t.token) for t in entries]
        offsets, at = [], 0
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {"tokens": texts, "token_logprobs": [t.logprob for t in entries],
                "top_logprobs": [{piece(i): lp for i, lp in t.top} for t in entries],
                "text_offset": offsets}

    def chat_logprobs(tokens: list[TokenLogprob | None]) -> dict:
        def entry(token: int, logprob: float) -> dict:
            text = piece(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(t.token, t.logprob),
                             "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                            for t in tokens if t is not None]}

    def usage(last: Event) -> dict:
        return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                "total_tokens": last.prompt_tokens + last.completion_tokens}

    def data(payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def events_of(request: Request, events: asyncio.Queue) -> AsyncIterator[Event]:
        while True:
            event = await events.get()
            yield event
            if event.finish is not None:
                return

    async def stream_completion(request, events, name, created, include_usage) -> AsyncIterator[str]:
        head = {"id": name, "object": "text_completion", "created": created, "model": config.model_name}
        wants_logprobs = request.params.logprobs is not None
        async for event in events_of(request, events):
            if event.finish is Finish.ERROR:
                yield data(error_body(f"generation failed: {event.error}", "server_error"))
                break
            if event.text or event.finish is not None or (wants_logprobs and event.tokens):
                yield data({**head, "choices": [{
                    "index": 0, "text": event.text,
                    "logprobs": completion_logprobs(list(event.logprobs)) if wants_logprobs else None,
                    "finish_reason": event.finish.value if event.finish else None}]})
            if event.finish is not None and include_usage:
                yield data({**head, "choices": [], "usage": usage(event)})
        yield "data: [DONE]\n\n"

    async def stream_chat(request, events, name, created, include_usage, wants_logprobs) -> AsyncIterator[str]:
        head = {"id": name, "object": "chat.completion.chunk", "created": created, "model": config.model_name}
        yield data({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]})
        async for event in events_of(request, events):
            if event.finish is Finish.ERROR:
                yield data(error_body(f"generation failed: {event.error}", "server_error"))
                break
            if event.text or (wants_logprobs and event.tokens):
                yield data({**head, "choices": [{
                    "index": 0, "delta": {"content": event.text},
                    "logprobs": chat_logprobs(list(event.logprobs)) if wants_logprobs else None,
                    "finish_reason": None}]})
            if event.finish is not None:
                yield data({**head, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                                 "finish_reason": event.finish.value}]})
                if include_usage:
                    yield data({**head, "choices": [], "usage": usage(event)})
        yield "data: [DONE]\n\n"

    def sse(chunks: AsyncIterator[str], request: Request) -> StreamingResponse:
        async def guarded() -> AsyncIterator[str]:
            finished = False
            try:
                async for chunk in chunks:
                    yield chunk
                finished = True
            finally:
                if not finished:
                    # The client went away (or the server is stopping): free the sequence.
                    request.cancel()

        return StreamingResponse(guarded(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return app


__all__ = ["ApiError", "ServeConfig", "create_app", "error_body"]
