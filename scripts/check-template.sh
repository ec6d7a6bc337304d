#!/usr/bin/env bash
# Deployment checks for template.yaml (docs/deploy.md, "CI checks"):
#   1. cfn-lint template.yaml
#   2. sam validate --lint (offline, dummy region)
#   3. checkov on the template, and again after the SAM transform: no failed checks (suppressions
#      are justified inline in the template's Metadata)
#   4. sam build: every function cross-compiled for arm64 by cargo-lambda, as `sam deploy` ships it
#      (falls back to `cargo lambda build --x86-64` per function when the arm64 Rust target cannot
#      be installed; the template still says arm64, so such a build is a compile check only).
# The tools come from requirements-deploy.txt, installed into .venv-deploy on first use (~75 s).
# Nothing calls AWS. `--no-build` stops after step 3 (~20 s).
#
# The build is niced and runs one rustc at a time (CARGO_BUILD_JOBS, default 1) in its own target
# dir, reused across runs (ONOFF_LAMBDA_TARGET_DIR, default ~/.cache/onoff-lambda-target). Cold it
# costs what docs/deploy.md records (22 min and 11 GB peak RSS here); warm, seconds to minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

build=1
for arg in "$@"; do
  case "$arg" in
    --no-build) build=0 ;;
    *) echo "usage: scripts/check-template.sh [--no-build]" >&2; exit 2 ;;
  esac
done

venv=$root/.venv-deploy
stamp=$venv/.requirements-deploy.txt
if [ ! -x "$venv/bin/sam" ] || ! cmp -s requirements-deploy.txt "$stamp"; then
  echo "== installing requirements-deploy.txt into .venv-deploy"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r requirements-deploy.txt
  cp requirements-deploy.txt "$stamp"
fi
# The venv first: sam, cfn-lint, checkov, cargo-lambda, and the python3 that has ziglang.
export PATH="$venv/bin:$PATH"
export SAM_CLI_TELEMETRY=0
# A dummy region; no credentials are needed, and none are looked up on an instance.
export AWS_REGION=us-east-1 AWS_DEFAULT_REGION=us-east-1 AWS_EC2_METADATA_DISABLED=true

timed() { # label, command...
  local label=$1 start end
  shift
  echo "== $label"
  start=$(date +%s)
  "$@"
  end=$(date +%s)
  echo "== $label: ok ($((end - start)) s)"
}

timed "cfn-lint template.yaml" cfn-lint template.yaml
timed "sam validate --lint" sam validate --lint --template-file template.yaml --region us-east-1
timed "checkov (cloudformation)" checkov --file template.yaml --framework cloudformation \
  --skip-download --quiet --compact
# Again on the template after the SAM transform, so the resources SAM generates (event rules,
# permissions, the SQS event source mapping, event invoke configs) are scanned too.
translated=$(mktemp -d)/template.json
python3 - "$translated" <<'PY'
import json, sys
from samtranslator.translator.transform import transform
from samtranslator.yaml_helper import yaml_parse

template = yaml_parse(open("template.yaml").read())
for res in template["Resources"].values():
    if res["Type"] == "AWS::Serverless::Function":
        res["Properties"]["CodeUri"] = "s3://bucket/key"  # what `sam package` puts there


class NoManagedPolicies:  # the template names no SAM policy templates or managed policies by name
    def load(self):
        return {}


json.dump(transform(template, {}, NoManagedPolicies()), open(sys.argv[1], "w"), indent=1)
PY
timed "checkov (after the SAM transform)" checkov --file "$translated" --framework cloudformation \
  --skip-download --quiet --compact
rm -rf "$(dirname "$translated")"

[ "$build" = 1 ] || exit 0

export CARGO_TARGET_DIR="${ONOFF_LAMBDA_TARGET_DIR:-$HOME/.cache/onoff-lambda-target}"
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-1}"
export CARGO_TERM_COLOR=never
# `cargo lambda build` has no --locked: fail afterwards if the build had to change Cargo.lock.
lock_before=$(sha256sum Cargo.lock)
# The functions' bins, as the template names them (BuildProperties.Binary).
mapfile -t bins < <(sed -n 's/^ *Binary: *\([A-Za-z0-9_-]*\) *$/\1/p' template.yaml)
[ "${#bins[@]}" -gt 0 ] || { echo "no BuildProperties.Binary in template.yaml" >&2; exit 1; }

if rustup target list --installed | grep -qx aarch64-unknown-linux-gnu \
  || rustup target add aarch64-unknown-linux-gnu; then
  build_dir=$root/.aws-sam/build
  timed "sam build (${bins[*]}: cargo lambda build --release --arm64)" \
    nice -n 19 sam build --template-file template.yaml --build-dir "$build_dir"
  # Each artifact must be an aarch64 ELF executable named bootstrap.
  for dir in "$build_dir"/*Function; do
    python3 - "$dir/bootstrap" <<'PY'
import struct, sys
path = sys.argv[1]
with open(path, "rb") as f:
    head = f.read(20)
assert head[:4] == b"\x7fELF", f"{path}: not an ELF file"
machine = struct.unpack_from("<H", head, 18)[0]
assert machine == 0xB7, f"{path}: e_machine {machine:#x}, not aarch64 (0xb7)"
import os
print(f"   {path}: aarch64 ELF, {os.path.getsize(path) / 1e6:.1f} MB")
PY
  done
else
  echo "!! the aarch64-unknown-linux-gnu Rust target cannot be installed: building for x86_64 instead" >&2
  for bin in "${bins[@]}"; do
    timed "cargo lambda build --release --x86-64 --bin $bin" \
      nice -n 19 cargo lambda build --release --x86-64 --bin "$bin"
  done
fi

if [ "$(sha256sum Cargo.lock)" != "$lock_before" ]; then
  echo "Cargo.lock changed during the build: it is out of date with the manifests" >&2
  exit 1
fi
