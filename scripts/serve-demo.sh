#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and starts `ft serve` on the built-in demo model (SmolLM2-135M-Instruct, CPU is
# fine) at 127.0.0.1:1919. Extra arguments go to `ft serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec ft serve "$@"
