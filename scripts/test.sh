#!/usr/bin/env bash
# Set up and run the whole test suite (CI runs exactly this).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# Compiled bytecode (fuel's and the assertion-rewritten tests') is kept between runs and
# shared by both workers and every `python -m fuel` subprocess the tests start.
unset PYTHONDONTWRITEBYTECODE
# --dist loadfile: a test file runs whole on one worker, so its module fixtures (a built engine,
# a JIT run) are built once per session; files go out in tests/conftest.py's order (the ones
# with slow tests first), not xdist's (most tests first).
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder "$@"
