#!/usr/bin/env bash
# The main job: build onoff (release) and replay the shipped busy week of the Philly trace through
# onoff's policy and the baselines. Extra arguments go to `onoff simulate` (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "cargo not found: install Rust from https://rustup.rs" >&2; exit 1; }
exec cargo run --release --locked --quiet -p onoff -- simulate "$@"
