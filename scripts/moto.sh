#!/usr/bin/env bash
# moto server for the integration tests: `source scripts/moto.sh; moto_start; ...; moto_stop`.
# Installs requirements-dev.txt into .venv once, starts moto on a free loopback port and exports
# ONOFF_TEST_AWS_ENDPOINT for the tests (and ONOFF_MOTO_SERVER, the program `onoff local` starts).
# Nothing here reaches beyond 127.0.0.1 once installed.

moto_venv() {
  local root; root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  local stamp="$root/.venv/.requirements-dev.txt"
  if [ ! -x "$root/.venv/bin/moto_server" ] || ! cmp -s "$root/requirements-dev.txt" "$stamp"; then
    echo "installing requirements-dev.txt into .venv" >&2
    python3 -m venv "$root/.venv"
    "$root/.venv/bin/pip" install --quiet --disable-pip-version-check -r "$root/requirements-dev.txt"
    cp "$root/requirements-dev.txt" "$stamp"
  fi
  MOTO_SERVER="$root/.venv/bin/moto_server"
  # What `onoff local` (and its end-to-end test) starts.
  export ONOFF_MOTO_SERVER="${ONOFF_MOTO_SERVER:-$MOTO_SERVER}"
}

moto_start() {
  moto_venv
  local port
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  MOTO_LOG=$(mktemp -t moto.XXXXXX.log)
  "$MOTO_SERVER" -H 127.0.0.1 -p "$port" >"$MOTO_LOG" 2>&1 &
  MOTO_PID=$!
  for _ in $(seq 1 100); do
    if python3 -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=1)" "http://127.0.0.1:$port/moto-api/" >/dev/null 2>&1; then
      export ONOFF_TEST_AWS_ENDPOINT="http://127.0.0.1:$port"
      echo "moto server on $ONOFF_TEST_AWS_ENDPOINT (pid $MOTO_PID)" >&2
      return 0
    fi
    sleep 0.2
  done
  echo "moto server did not start; its log:" >&2
  cat "$MOTO_LOG" >&2
  return 1
}

moto_stop() {
  if [ -n "${MOTO_PID:-}" ]; then
    kill "$MOTO_PID" 2>/dev/null || true
    wait "$MOTO_PID" 2>/dev/null || true
    unset MOTO_PID
  fi
}
