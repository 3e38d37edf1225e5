#!/usr/bin/env bash
# Formatting and lint for both languages (part of scripts/test.sh): rustfmt (rustfmt.toml), clippy with warnings
# as errors, ruff's formatter and its small rule set (pyproject.toml [tool.ruff]). Fix with `cargo fmt`,
# `ruff format python kernels tests bench scripts` and `ruff check --fix`.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
    rustup component add rustfmt clippy  # minimal toolchain profiles ship without them
fi
cargo fmt --check
cargo clippy --release --all-targets --quiet -- -D warnings
ruff format --check --quiet python kernels tests bench scripts
ruff check --quiet python kernels tests bench scripts
