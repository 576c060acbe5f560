"""Putting a server together: model -> scheduler -> app -> uvicorn, in the foreground (``fuel
serve``) or on a background thread (tests, the load benchmark).

Decides the defaults a server starts with (127.0.0.1, the scheduler's batch and budget) and how
a background server is started and stopped: it listens on a socket bound before it starts
(port 0 picks a free one), and :meth:`BackgroundServer.close` stops uvicorn and the
scheduler's thread.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from fuel.runtime.scheduler import Scheduler
from fuel.serve.app import ServeConfig, create_app
from fuel.serve.metrics import Metrics

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


@dataclass(frozen=True, slots=True)
class ServeOptions:
    max_batch: int = 8
    token_budget: int = 256
    speculate: int = 0
    drafter: str = "prompt-lookup"
    api_key: str | None = None
    model_name: str | None = None
    default_max_tokens: int = 256
    pad_rows: bool = True


def build_app(model: Any, options: ServeOptions):
    """The app, its scheduler and its metrics over a loaded :class:`fuel.runtime.model.Model`."""
    from fuel.runtime.model import make_drafter

    metrics = Metrics()
    eos = model.tokenizer.eos_id
    scheduler = Scheduler(model.engine, model.tokenizer, max_batch=options.max_batch,
                          token_budget=options.token_budget, speculate=options.speculate,
                          drafter=make_drafter(options.drafter) if options.speculate else None,
                          stop_token_ids=[eos] if eos is not None else [], observer=metrics,
                          pad_rows=options.pad_rows)
    config = ServeConfig(model_name=options.model_name or model.name, api_key=options.api_key,
                         default_max_tokens=options.default_max_tokens)
    return create_app(scheduler, model.tokenizer, metrics, config), scheduler, metrics


def uvicorn_config(app, host: str, port: int):
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                          lifespan="on", timeout_graceful_shutdown=2)


def serve_forever(model: Any, options: ServeOptions, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> None:
    import uvicorn

    app, _, _ = build_app(model, options)
    uvicorn.Server(uvicorn_config(app, host, port)).run()


class BackgroundServer:
    """A server on a background thread, listening on ``host:port`` (0: a free port)."""

    def __init__(self, model: Any, options: ServeOptions, host: str = DEFAULT_HOST, port: int = 0):
        import uvicorn

        self.app, self.scheduler, self.metrics = build_app(model, options)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        self._server = uvicorn.Server(uvicorn_config(self.app, host, self.port))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="fuel-serve", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"fuel serve did not start on {self.url}")
            time.sleep(0.02)
        return self

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *_) -> None:
        self.close()


__all__ = ["BackgroundServer", "DEFAULT_HOST", "DEFAULT_PORT", "ServeOptions", "build_app", "serve_forever"]
