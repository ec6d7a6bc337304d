#!/usr/bin/env bash
# The main job: the whole system on this machine. Installs moto server into .venv (once), builds
# onoff and onoff-agent, and runs `onoff local`: moto stands in for AWS, the control plane's
# handlers run on their real triggers, every launched instance becomes a real agent process, and a
# slice of the real Philly trace is replayed with spot notices and worker kills injected.
# Extra arguments go to `onoff local` (try --help).
#
#   scripts/run.sh simulate [ARGS]   runs the trace-replay simulator instead (optimised `sim` build,
#                                    without the AWS SDK): onoff's policy against the baselines.
#   scripts/run.sh --serve           serves a local stack until Ctrl-C, taking any client's jobs;
#   scripts/run.sh idle-cost [SECONDS]
#                                    serves an idle local stack SECONDS (default 120), then prices
#                                    a month of it idle (scripts/idle_cost.py);
#   scripts/run.sh VERB [ARGS]       any other `onoff` command, e.g. the operator verbs submit,
#                                    jobs, status, logs, cancel, outputs, cost and workers
#                                    (`--local` for the served stack, `--stack NAME` for a
#                                    deployed one); `onoff --help` lists them.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "cargo not found: install Rust from https://rustup.rs" >&2; exit 1; }
command -v python3 >/dev/null || { echo "python3 not found: install Python 3 with venv" >&2; exit 1; }
if [ "${1:-}" = "simulate" ]; then
  shift
  exec cargo run --profile sim --locked --quiet --no-default-features -p onoff -- simulate "$@"
fi
source scripts/moto.sh
moto_venv
target_dir="${CARGO_TARGET_DIR:-target}"
if [ ! -x "$target_dir/debug/onoff" ]; then
  echo "building onoff and onoff-agent (the first build compiles the AWS SDK: about 10 minutes)" >&2
fi
# The same build as the test command's (`cargo test` features), so the two share every artifact:
# a plain `cargo build` resolves dependency features differently and compiles the SDK again.
cargo test --workspace --locked --no-run --quiet
case "${1:-}" in
  idle-cost)
    seconds="${2:-120}"
    run_dir="$(mktemp -d)"
    echo "serving an idle stack for ${seconds} s (the reconciler every 5 s); run dir $run_dir" >&2
    # SIGTERM ends the session (timeout's exit status 124), which then prints its report.
    timeout -s TERM "$seconds" "$target_dir/debug/onoff" local --serve --tick-s 5 --run-dir "$run_dir" \
      --json --quiet > "$run_dir/report.json" || [ $? -eq 124 ]
    exec python3 scripts/idle_cost.py "$run_dir"
    ;;
  # No arguments, or options only: `onoff local` with them (the main job).
  "" | -*) exec "$target_dir/debug/onoff" local "$@" ;;
  # Any other word is an `onoff` command (clap refuses one it does not know, with the list).
  *) exec "$target_dir/debug/onoff" "$@" ;;
esac
