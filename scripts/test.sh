#!/usr/bin/env bash
# The test command: every test of the workspace, then the dependency-direction check.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --locked
scripts/check-deps.sh
