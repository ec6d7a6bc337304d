#!/usr/bin/env bash
# Dependency direction (STYLE.md): policy has no tokio / aws / lambda in its tree; control has no
# aws / lambda; sim never depends on aws; aws never on lambda_runtime (the agent reuses it).
set -euo pipefail
cd "$(dirname "$0")/.."
fail=0
check() { # crate, forbidden regex
  local tree
  tree=$(cargo tree --locked -e normal -p "$1" --prefix none)
  if grep -Eq "$2" <<<"$tree"; then
    echo "dependency direction violated: $1 depends on $(grep -E "$2" <<<"$tree" | sort -u | tr '\n' ' ')" >&2
    fail=1
  else
    echo "ok: $1 has nothing matching $2"
  fi
}
check onoff-policy '^(tokio|aws-|lambda_|onoff-control|onoff-sim|onoff-aws) '
check onoff-control '^(aws-|lambda_|onoff-sim|onoff-aws) '
check onoff-sim '^(aws-|lambda_|onoff-aws) '
check onoff-aws '^(lambda_|lambda-runtime|aws_lambda_events|onoff-sim) '
exit $fail
