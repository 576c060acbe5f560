#!/usr/bin/env bash
# Set up and run fuel's main job on its built-in default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh run,jit
exec .venv/bin/fuel demo "$@"
