#!/usr/bin/env python3
"""Example onoff workload: the trace of M^8 mod p for one seeded matrix M per item.

Real computation over input items that follows the job contract in worker-image/README.md:

- items are integer seeds, read from $ONOFF_JOB_INPUT (one per line) or counted from --seed;
- per item: a deterministic SIZE x SIZE matrix from the seed (64-bit LCG), its 8th power by three
  squarings modulo the prime 65521, and the trace of that power mod 65521;
- the traces fold, in order, into a SHA-256 hash chain: the result digest;
- `ONOFF_ITEMS <n>` on stdout after every item (n counts the whole job, items before a resume too);
- a checkpoint every --checkpoint-every items, written to $ONOFF_CHECKPOINT_DIR/.tmp-<n> and renamed
  to $ONOFF_CHECKPOINT_DIR/<n> (n = items done, so numbers keep growing across resumed attempts);
- resumes from $ONOFF_RESUME_DIR/state.json when there is one;
- stops after the current item on SIGTERM or when $ONOFF_STOP_FILE exists: checkpoint, exit 143;
- when $ONOFF_CHECKPOINT_NOW_FILE exists (a rebalance recommendation), writes a checkpoint after the
  current item, deletes the file and keeps going;
- with --model-mb M, first loads a "model" of M MiB (deterministic bytes, folded into the digest):
  from $ONOFF_CACHE_DIR when an earlier job of the project left it there on this worker, else it
  builds it (the stand-in for a download) and leaves it there for the next job.

Runs on the Python 3 standard library alone (CPU). When `torch` imports and CUDA is available it does
the matrix products on the GPU instead, with the same result: the products are done in float64,
which is exact here because every entry is below p = 65521 and a dot product of SIZE terms stays
below SIZE * p^2 < 2^53 (SIZE <= MAX_SIZE); the reduction mod p is done in int64.

Exit codes: 0 done, 143 stopped (checkpoint written), 3 --fail-at reached, 2 bad arguments, input or
checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import sys
import time
from operator import mul

PRIME = 65521
"""The modulus: the largest prime below 2^16."""
SQUARINGS = 3
"""M^8 = ((M^2)^2)^2."""
MAX_SIZE = (1 << 53) // ((PRIME - 1) ** 2)
"""Largest size for which a float64 dot product of entries below PRIME is exact (2,098,176)."""
LCG_A = 6364136223846793005
LCG_C = 1442695040888963407
MASK64 = (1 << 64) - 1
FORMAT = "onoff-matmul-items/1"
"""Tag of the digest chain and of state.json; a checkpoint with another tag is refused."""

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_FAIL_AT = 3
EXIT_STOPPED = 143


class BadInput(Exception):
    """Arguments, input file or resume checkpoint that cannot be used (exit 2)."""


# --- the computation ----------------------------------------------------------------------------


def item_matrix(seed: int, size: int) -> list[list[int]]:
    """The item's matrix: entries in [0, PRIME) from a 64-bit LCG started at `seed`, row by row."""
    x = seed & MASK64
    rows = []
    for _ in range(size):
        row = []
        for _ in range(size):
            x = (x * LCG_A + LCG_C) & MASK64
            row.append((x >> 33) % PRIME)
        rows.append(row)
    return rows


def square_mod(m: list[list[int]]) -> list[list[int]]:
    """M*M mod PRIME with Python integers."""
    cols = list(zip(*m))
    return [[sum(map(mul, row, col)) % PRIME for col in cols] for row in m]


def trace_python(seed: int, size: int) -> int:
    """trace(M^8) mod PRIME for the item `seed`, on the CPU with the standard library."""
    m = item_matrix(seed, size)
    for _ in range(SQUARINGS):
        m = square_mod(m)
    return sum(m[i][i] for i in range(size)) % PRIME


class TorchTracer:
    """trace(M^8) mod PRIME with PyTorch on `device`: float64 products (exact, see the module doc),
    int64 reductions."""

    def __init__(self, torch, device: str):
        self.torch = torch
        self.device = device

    def __call__(self, seed: int, size: int) -> int:
        torch = self.torch
        m = torch.tensor(item_matrix(seed, size), dtype=torch.float64, device=self.device)
        for _ in range(SQUARINGS):
            m = (m @ m).to(torch.int64).remainder(PRIME).to(torch.float64)
        return int(m.to(torch.int64).diagonal().sum().item()) % PRIME


def chain_start(size: int) -> bytes:
    """The digest of zero items."""
    return hashlib.sha256(f"{FORMAT} size={size}".encode()).digest()


def chain_next(digest: bytes, trace: int) -> bytes:
    """Fold one item's trace into the digest."""
    return hashlib.sha256(digest + f"{trace}\n".encode()).digest()


MODEL_TAG = b"onoff-matmul-items/model/1"
"""Seeds the model's bytes; another model is another tag."""


def model_bytes(mib: int) -> bytes:
    """The model of `mib` MiB: SHA-256 of the tag and a counter, block after block."""
    blocks = (mib << 20) // 32
    return b"".join(hashlib.sha256(MODEL_TAG + i.to_bytes(8, "little")).digest() for i in range(blocks))


def load_model(mib: int, cache_dir: str | None) -> tuple[bytes, str]:
    """The model's SHA-256 and where it came from: `cache` ($ONOFF_CACHE_DIR held it, written by an
    earlier job of the project on this worker) or `built` (then left in the cache, written under a
    temporary name and renamed, so a job never finds half of it)."""
    path = os.path.join(cache_dir, f"matmul-model-{mib}mib.bin") if cache_dir else None
    if path:
        try:
            with open(path, "rb") as f:
                data = f.read()
            if len(data) == mib << 20:
                return hashlib.sha256(data).digest(), "cache"
        except OSError:
            pass
    data = model_bytes(mib)
    if path:
        try:
            tmp = f"{path}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            print(f"model: not kept in {cache_dir}: {e}", file=sys.stderr, flush=True)
    return hashlib.sha256(data).digest(), "built"


def items_fingerprint(seeds: list[int]) -> str:
    """Identifies the item list, so a checkpoint is never resumed against other items."""
    return hashlib.sha256(",".join(map(str, seeds)).encode()).hexdigest()


# --- items, checkpoints, stop -------------------------------------------------------------------


def read_seeds(path: str) -> list[int]:
    """One integer per line; blank lines ignored."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read ONOFF_JOB_INPUT {path}: {e}") from None
    seeds = []
    for lineno, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        try:
            seeds.append(int(text))
        except ValueError:
            raise BadInput(f"{path}:{lineno}: not an integer: {text!r}") from None
    return seeds


def item_seeds(args: argparse.Namespace, env: dict) -> list[int]:
    input_path = env.get("ONOFF_JOB_INPUT")
    if input_path:
        seeds = read_seeds(input_path)
        return seeds if args.items is None else seeds[: args.items]
    if args.items is None:
        raise BadInput("--items is required when ONOFF_JOB_INPUT is not set")
    return list(range(args.seed, args.seed + args.items))


def load_resume(resume_dir: str, size: int, fingerprint: str, total: int) -> tuple[int, bytes] | None:
    """(next item, digest) from `resume_dir`/state.json, None when there is no state.json."""
    path = os.path.join(resume_dir, "state.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        fmt, next_item, digest = state["format"], int(state["next_item"]), bytes.fromhex(state["digest"])
        saved_size, saved_fingerprint = int(state["size"]), state["items_fingerprint"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadInput(f"unreadable checkpoint {path}: {e}") from None
    if fmt != FORMAT:
        raise BadInput(f"checkpoint {path} has format {fmt!r}, expected {FORMAT!r}")
    if saved_size != size:
        raise BadInput(f"checkpoint {path} is for --size {saved_size}, this run has --size {size}")
    if saved_fingerprint != fingerprint:
        raise BadInput(f"checkpoint {path} is for another list of items")
    if not 0 <= next_item <= total or len(digest) != 32:
        raise BadInput(f"checkpoint {path} is inconsistent: next_item {next_item} of {total}")
    return next_item, digest


def write_checkpoint(checkpoint_dir: str, state: dict) -> str:
    """Write `state` as checkpoint number state["next_item"]: into .tmp-<n>, renamed to <n> once
    complete; then delete the older numbered checkpoints (renamed to .old-<m> first). Returns the
    checkpoint's path."""
    n = state["next_item"]
    tmp = os.path.join(checkpoint_dir, f".tmp-{n}")
    final = os.path.join(checkpoint_dir, str(n))
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with open(os.path.join(tmp, "state.json"), "w", encoding="utf-8") as f:
        json.dump(state, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, final)
    try:
        fd = os.open(checkpoint_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # a directory fsync is best effort (not every filesystem allows it)
    # An older checkpoint leaves by a rename first, so no numbered directory is ever seen half
    # deleted (the agent may be listing or uploading them meanwhile).
    for name in os.listdir(checkpoint_dir):
        if name.isdigit() and int(name) < n:
            doomed = os.path.join(checkpoint_dir, f".old-{name}")
            os.rename(os.path.join(checkpoint_dir, name), doomed)
            shutil.rmtree(doomed, ignore_errors=True)
    return final


class StopFlag:
    """Set by SIGTERM; also reads as set once the stop file exists."""

    def __init__(self, stop_file: str | None):
        self.stop_file = stop_file
        self.signalled = False

    def on_signal(self, signum, frame):  # noqa: ARG002 (signal handler signature)
        self.signalled = True

    def is_set(self) -> bool:
        return self.signalled or bool(self.stop_file and os.path.exists(self.stop_file))


def choose_tracer(wanted: str):
    """(tracer, device name) for --device: `cpu` is the standard library, `cuda` needs torch with
    CUDA, `auto` takes CUDA when it is there."""
    if wanted == "cpu":
        return trace_python, "cpu"
    try:
        import torch  # noqa: PLC0415 (optional dependency)

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if cuda:
        return TorchTracer(torch, "cuda"), "cuda"
    if wanted == "cuda":
        raise BadInput("--device cuda: torch is not importable or CUDA is not available")
    return trace_python, "cpu"


# --- the job ------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="matmul_items.py",
        description="onoff example workload: for each item (an integer seed) build a seeded SIZE x SIZE "
        "matrix, raise it to the 8th power modulo 65521 and fold its trace into a SHA-256 digest. "
        "Follows the onoff job contract (ONOFF_* variables: input, checkpoints, resume, stop file).",
        epilog="Exit codes: 0 done, 143 stopped on SIGTERM or the stop file (checkpoint written), "
        "3 --fail-at reached, 2 bad arguments, input or checkpoint.",
    )
    p.add_argument("--items", type=int, metavar="N",
                   help="number of items; with ONOFF_JOB_INPUT, at most this many of its seeds")
    p.add_argument("--size", type=int, default=32, metavar="S", help="matrix size (default 32)")
    p.add_argument("--seed", type=int, default=0, metavar="K",
                   help="first seed when there is no input file: items are K, K+1, ... (default 0)")
    p.add_argument("--checkpoint-every", type=int, default=10, metavar="C",
                   help="write a checkpoint every C items when ONOFF_CHECKPOINT_DIR is set (default 10)")
    p.add_argument("--output", metavar="PATH", help='write {"items", "digest", "device", "size"} as JSON here')
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): CUDA through torch when available, else the CPU")
    p.add_argument("--min-item-ms", type=float, default=0.0, metavar="MS",
                   help="sleep so that each item takes at least MS milliseconds (for replays that need "
                   "predictable job durations; default 0)")
    p.add_argument("--model-mb", type=int, default=0, metavar="M",
                   help="load a model of M MiB first, from $ONOFF_CACHE_DIR when it is there (default 0: none)")
    p.add_argument("--fail-at", type=int, metavar="I",
                   help="for tests: exit 3 on reaching item I (0-based), before computing it")
    p.add_argument("--fail-attempts", type=int, metavar="A",
                   help="with --fail-at: fail only while ONOFF_ATTEMPT <= A (default: every attempt)")
    args = p.parse_args(argv)
    if args.items is not None and args.items < 0:
        p.error("--items must be >= 0")
    if not 1 <= args.size <= MAX_SIZE:
        p.error(f"--size must be between 1 and {MAX_SIZE}")
    if args.checkpoint_every < 1:
        p.error("--checkpoint-every must be >= 1")
    if args.min_item_ms < 0:
        p.error("--min-item-ms must be >= 0")
    if not 0 <= args.model_mb <= 4096:
        p.error("--model-mb must be between 0 and 4096")
    return args


def run(args: argparse.Namespace, env: dict, stop: StopFlag) -> int:
    seeds = item_seeds(args, env)
    total = len(seeds)
    fingerprint = items_fingerprint(seeds)
    tracer, device = choose_tracer(args.device)
    checkpoint_dir = env.get("ONOFF_CHECKPOINT_DIR") or None

    start, digest = 0, chain_start(args.size)
    model = None
    if args.model_mb:
        model_digest, model = load_model(args.model_mb, env.get("ONOFF_CACHE_DIR") or None)
        digest = hashlib.sha256(digest + model_digest).digest()
        print(f"model: {args.model_mb} MiB, {'from the cache' if model == 'cache' else 'built'}",
              file=sys.stderr, flush=True)
    resume_dir = env.get("ONOFF_RESUME_DIR")
    if resume_dir:
        resumed = load_resume(resume_dir, args.size, fingerprint, total)
        if resumed is None:
            print(f"no state.json in ONOFF_RESUME_DIR={resume_dir}; starting at item 0", file=sys.stderr)
        else:
            start, digest = resumed
            print(f"resumed from checkpoint at item {start}", file=sys.stderr, flush=True)
            print(f"ONOFF_ITEMS {start}", flush=True)
    print(f"matmul_items: {total} items, size {args.size}, device {device}, from item {start}",
          file=sys.stderr, flush=True)

    def state(next_item: int) -> dict:
        return {
            "format": FORMAT,
            "next_item": next_item,
            "digest": digest.hex(),
            "size": args.size,
            "items_total": total,
            "items_fingerprint": fingerprint,
            "device": device,
        }

    last_checkpoint = start  # the resumed checkpoint already holds this state
    now_file = env.get("ONOFF_CHECKPOINT_NOW_FILE") or None
    fail_now = args.fail_at is not None and (
        args.fail_attempts is None or int(env.get("ONOFF_ATTEMPT") or 1) <= args.fail_attempts
    )
    for i in range(start, total):
        if stop.is_set():
            why = "SIGTERM" if stop.signalled else f"stop file {stop.stop_file}"
            if checkpoint_dir and i > last_checkpoint:
                path = write_checkpoint(checkpoint_dir, state(i))
                print(f"stopping on {why}: checkpoint {path} at item {i}", file=sys.stderr, flush=True)
            else:
                print(f"stopping on {why} at item {i} (no new checkpoint)", file=sys.stderr, flush=True)
            return EXIT_STOPPED
        if fail_now and i == args.fail_at:
            print(f"--fail-at {i}: failing on purpose", file=sys.stderr, flush=True)
            return EXIT_FAIL_AT
        began = time.monotonic()
        digest = chain_next(digest, tracer(seeds[i], args.size))
        if args.min_item_ms:
            time.sleep(max(0.0, args.min_item_ms / 1000 - (time.monotonic() - began)))
        print(f"ONOFF_ITEMS {i + 1}", flush=True)
        asked = bool(now_file and os.path.exists(now_file))
        if checkpoint_dir and i + 1 < total and (asked or (i + 1) % args.checkpoint_every == 0):
            write_checkpoint(checkpoint_dir, state(i + 1))
            last_checkpoint = i + 1
            if asked:
                print(f"checkpoint at item {i + 1}: asked by {now_file}", file=sys.stderr, flush=True)
        if asked:
            try:
                os.remove(now_file)
            except FileNotFoundError:
                pass

    print(f"ONOFF_RESULT {digest.hex()}", flush=True)
    if args.output:
        tmp = f"{args.output}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            result = {"items": total, "digest": digest.hex(), "device": device, "size": args.size}
            if model:
                result["model"] = model
            json.dump(result, f)
            f.write("\n")
        os.replace(tmp, args.output)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    stop = StopFlag(os.environ.get("ONOFF_STOP_FILE") or None)
    signal.signal(signal.SIGTERM, stop.on_signal)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args, dict(os.environ), stop)
    except BadInput as e:
        print(f"matmul_items: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
