#!/usr/bin/env bash
# The test command: every test of the workspace (the AWS adapters against a moto server this
# script installs and starts on loopback, then stops), then the dependency-direction check.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/moto.sh
moto_start
trap moto_stop EXIT
cargo test --workspace --locked
echo "== example workload (python unittest)" >&2
python3 -m unittest discover -s worker-image/examples -p 'test_*.py'
echo "== scripts (python unittest)" >&2
python3 -m unittest discover -s scripts -p 'test_*.py'
scripts/check-deps.sh
