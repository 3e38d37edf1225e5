#!/usr/bin/env bash
# Sets up (scripts/setup.sh), checks formatting and lint (scripts/lint.sh), and runs every test: the Rust crates,
# then the Python suite (GPU tests skip without CUDA). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
bash scripts/lint.sh
cargo test --release  # release: shares the dependency build with the extension (maturin builds release)
python -m pytest -q -rs tests "$@"   # -rs: say why each skipped test skipped
