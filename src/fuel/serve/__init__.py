"""``fuel serve``: an OpenAI-compatible HTTP server over the continuous-batching scheduler.

The public surface: :class:`ServeOptions`, :func:`build_app`, :func:`serve_forever`,
:class:`BackgroundServer` (``fuel.serve.server``) and :func:`create_app` (``fuel.serve.app``).
Needs the ``serve`` extra (FastAPI, uvicorn, prometheus_client).
"""

from fuel.serve.server import BackgroundServer, ServeOptions, build_app, serve_forever

__all__ = ["BackgroundServer", "ServeOptions", "build_app", "serve_forever"]
