#!/usr/bin/env bash
# Set up and run the whole test suite (CI runs exactly this).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# Compiled bytecode (fuel's and the assertion-rewritten tests') is kept between runs and
# shared by both workers and every `python -m fuel` subprocess the tests start.
unset PYTHONDONTWRITEBYTECODE
# --dist loadgroup: a module whose tests share a module-scoped fixture runs on one worker
# (tests/conftest.py marks it), so a built engine or JIT run is built once per session.
exec .venv/bin/python -m pytest -q -n 2 --dist loadgroup "$@"
