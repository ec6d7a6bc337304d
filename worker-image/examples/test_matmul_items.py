"""Tests of the example workload, run from the repository root with
`python3 -m unittest discover -s worker-image/examples -p 'test_*.py'`.

The job runs as a subprocess, as the agent runs it: environment in, stdout lines, exit code and
checkpoint directories out.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "matmul_items.py")
sys.path.insert(0, HERE)

import matmul_items as mi  # noqa: E402

# Pinned: the digest of `--items 5 --size 4 --seed 0`. It changes only if the computation or the
# digest format changes, which must then also change mi.FORMAT (old checkpoints become unusable).
GOLDEN_5x4 = "43fb4c0beb1897ea629e777943512a34c1ae89951b3c6a902b13274d41d68fb9"

SIZE = 6  # small: each item takes well under a millisecond
TIMEOUT = 20


def naive_trace(seed: int, size: int) -> int:
    """trace(M^8) mod p by seven plain multiplications: independent of the squaring code."""
    m = mi.item_matrix(seed, size)
    power = m
    for _ in range(7):
        power = [
            [sum(power[r][k] * m[k][c] for k in range(size)) % mi.PRIME for c in range(size)]
            for r in range(size)
        ]
    return sum(power[i][i] for i in range(size)) % mi.PRIME


def expected_digest(seeds, size: int) -> str:
    h = hashlib.sha256(f"{mi.FORMAT} size={size}".encode()).digest()
    for s in seeds:
        h = hashlib.sha256(h + f"{naive_trace(s, size)}\n".encode()).digest()
    return h.hex()


def job_env(**onoff) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONOFF_")}
    env.update({k: str(v) for k, v in onoff.items()})
    return env


def run_job(args, **onoff) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, "--device", "cpu", *map(str, args)],
        env=job_env(**onoff),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def result_digest(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("ONOFF_RESULT ")]
    assert len(lines) == 1, stdout
    return lines[0].split()[1]


def items_reported(stdout: str) -> list[int]:
    return [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("ONOFF_ITEMS ")]


def numbered(checkpoint_dir: str) -> list[str]:
    return sorted((n for n in os.listdir(checkpoint_dir) if n.isdigit()), key=int)


class ComputationTest(unittest.TestCase):
    def test_squaring_matches_plain_multiplication(self):
        for seed in (0, 1, 12345, -7, 2**70):
            for size in (1, 2, 5, 9):
                self.assertEqual(mi.trace_python(seed, size), naive_trace(seed, size), (seed, size))

    def test_matrix_is_deterministic_and_reduced(self):
        a = mi.item_matrix(42, 8)
        self.assertEqual(a, mi.item_matrix(42, 8))
        self.assertNotEqual(a, mi.item_matrix(43, 8))
        self.assertTrue(all(0 <= v < mi.PRIME for row in a for v in row))

    def test_float64_exactness_bound(self):
        # the GPU path relies on SIZE * (p-1)^2 < 2^53 for every size it accepts
        self.assertLess(mi.MAX_SIZE * (mi.PRIME - 1) ** 2, 2**53)


class JobTest(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory()
        self.tmp = self._tmp.name

    def tearDown(self):
        self._tmp.cleanup()

    def path(self, *parts) -> str:
        return os.path.join(self.tmp, *parts)

    def mkdir(self, name) -> str:
        os.makedirs(self.path(name))
        return self.path(name)

    def test_help(self):
        p = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=TIMEOUT)
        self.assertEqual(p.returncode, 0)
        self.assertIn("--checkpoint-every", p.stdout)

    def test_full_run_is_deterministic(self):
        out = self.path("result.json")
        first = run_job(["--items", 5, "--size", 4, "--output", out])
        self.assertEqual(first.returncode, 0, first.stderr)
        self.assertEqual(result_digest(first.stdout), GOLDEN_5x4)
        self.assertEqual(GOLDEN_5x4, expected_digest(range(5), 4))
        self.assertEqual(items_reported(first.stdout), [1, 2, 3, 4, 5])
        with open(out) as f:
            self.assertEqual(json.load(f), {"items": 5, "digest": GOLDEN_5x4, "device": "cpu", "size": 4})
        second = run_job(["--items", 5, "--size", 4])
        self.assertEqual(result_digest(second.stdout), GOLDEN_5x4)
        other_seed = run_job(["--items", 5, "--size", 4, "--seed", 1])
        self.assertNotEqual(result_digest(other_seed.stdout), GOLDEN_5x4)

    def test_a_model_is_built_once_and_then_read_from_the_cache_with_the_same_result(self):
        cache = self.path("cache")
        os.makedirs(cache)
        out = self.path("result.json")
        args = ["--items", 5, "--size", 4, "--model-mb", 1, "--output", out]
        first = run_job(args, ONOFF_CACHE_DIR=cache)
        self.assertEqual(first.returncode, 0, first.stderr)
        self.assertIn("model: 1 MiB, built", first.stderr)
        with open(out) as f:
            self.assertEqual(json.load(f)["model"], "built")
        self.assertEqual(os.listdir(cache), ["matmul-model-1mib.bin"])
        second = run_job(args, ONOFF_CACHE_DIR=cache)
        self.assertIn("model: 1 MiB, from the cache", second.stderr)
        with open(out) as f:
            self.assertEqual(json.load(f)["model"], "cache")
        # The model is in the result, wherever it came from; none, the result is the golden one.
        self.assertEqual(result_digest(first.stdout), result_digest(second.stdout))
        no_cache = run_job(args)
        self.assertIn("built", no_cache.stderr)
        self.assertEqual(result_digest(no_cache.stdout), result_digest(first.stdout))
        self.assertNotEqual(result_digest(first.stdout), GOLDEN_5x4)
        model = hashlib.sha256(mi.model_bytes(1)).digest()
        start = hashlib.sha256(hashlib.sha256(f"{mi.FORMAT} size=4".encode()).digest() + model).digest()
        h = start
        for seed in range(5):
            h = hashlib.sha256(h + f"{naive_trace(seed, 4)}\n".encode()).digest()
        self.assertEqual(result_digest(first.stdout), h.hex())
        # A half-written model (a job killed while it wrote one under its final name) is built again.
        with open(os.path.join(cache, "matmul-model-1mib.bin"), "r+b") as f:
            f.truncate(1000)
        third = run_job(args, ONOFF_CACHE_DIR=cache)
        self.assertIn("built", third.stderr)
        self.assertEqual(result_digest(third.stdout), result_digest(first.stdout))

    def test_input_file_seeds(self):
        seeds_file = self.path("seeds.txt")
        with open(seeds_file, "w") as f:
            f.write("7\n\n3\n  11  \n\n-2\n")
        p = run_job(["--size", SIZE], ONOFF_JOB_INPUT=seeds_file)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(result_digest(p.stdout), expected_digest([7, 3, 11, -2], SIZE))
        capped = run_job(["--size", SIZE, "--items", 2, "--seed", 100], ONOFF_JOB_INPUT=seeds_file)
        self.assertEqual(result_digest(capped.stdout), expected_digest([7, 3], SIZE))
        self.assertEqual(items_reported(capped.stdout), [1, 2])

    def test_bad_input_file_exits_2(self):
        seeds_file = self.path("seeds.txt")
        with open(seeds_file, "w") as f:
            f.write("1\ntwo\n")
        p = run_job(["--size", SIZE], ONOFF_JOB_INPUT=seeds_file)
        self.assertEqual(p.returncode, 2)
        self.assertIn("seeds.txt:2", p.stderr)
        self.assertEqual(run_job(["--size", SIZE]).returncode, 2)  # neither --items nor an input file

    def test_checkpoints_are_complete_numbered_dirs(self):
        ckpt = self.mkdir("ckpt")
        seen_complete: set[str] = set()
        problems: list[str] = []
        done = threading.Event()

        def watch():
            while not done.is_set():
                for name in os.listdir(ckpt):
                    if name.startswith((".tmp-", ".old-")):
                        continue
                    if not name.isdigit():
                        problems.append(f"unexpected entry {name}")
                        continue
                    try:
                        with open(os.path.join(ckpt, name, "state.json")) as f:
                            state = json.load(f)
                    except FileNotFoundError:
                        if os.path.isdir(os.path.join(ckpt, name)):
                            problems.append(f"{name} without state.json")
                        continue  # renamed away as older between listdir and open
                    if state["next_item"] != int(name):
                        problems.append(f"{name} holds next_item {state['next_item']}")
                    seen_complete.add(name)
                time.sleep(0.002)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            p = run_job(["--items", 20, "--size", SIZE, "--checkpoint-every", 3, "--min-item-ms", 15],
                        ONOFF_CHECKPOINT_DIR=ckpt)
        finally:
            done.set()
            watcher.join()
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(problems, [])
        self.assertGreaterEqual(len(seen_complete), 2, seen_complete)
        # the last one (18) is left; the older ones were deleted; no temporary dir remains
        self.assertEqual(os.listdir(ckpt), ["18"])
        with open(os.path.join(ckpt, "18", "state.json")) as f:
            state = json.load(f)
        self.assertEqual(state["next_item"], 18)
        self.assertEqual(state["size"], SIZE)

    def test_checkpoint_now_file_writes_one_at_once_and_keeps_running(self):
        ckpt, now_file = self.mkdir("ckpt"), self.path("checkpoint-now")
        with open(now_file, "w"):
            pass
        # --checkpoint-every larger than the job: only the asked-for checkpoint is written.
        p = run_job(["--items", 6, "--size", SIZE, "--checkpoint-every", 100],
                    ONOFF_CHECKPOINT_DIR=ckpt, ONOFF_CHECKPOINT_NOW_FILE=now_file)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertFalse(os.path.exists(now_file), "the job deletes the file once the checkpoint is in place")
        self.assertEqual(numbered(ckpt), ["1"], "one checkpoint, after the first item")
        self.assertIn("asked by", p.stderr)
        self.assertEqual(items_reported(p.stdout), list(range(1, 7)), "it kept running to the end")

    def test_no_checkpoint_dir_means_no_checkpoints(self):
        p = run_job(["--items", 12, "--size", SIZE, "--checkpoint-every", 2], ONOFF_STOP_FILE=self.path("stop"))
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(os.listdir(self.tmp), [])

    def interrupt_and_resume(self, interrupt):
        """Start a slowed run, `interrupt(process)` once 5 items are done, expect exit 143 and one
        checkpoint; resume from it in a new attempt and compare with an uninterrupted run."""
        total = 30
        args = ["--items", total, "--size", SIZE, "--checkpoint-every", 4]
        full = run_job(args)
        self.assertEqual(full.returncode, 0, full.stderr)

        ckpt1, stop_file = self.mkdir("ckpt1"), self.path("stop")
        proc = subprocess.Popen(
            [sys.executable, SCRIPT, "--device", "cpu", *map(str, args), "--min-item-ms", "20"],
            env=job_env(ONOFF_CHECKPOINT_DIR=ckpt1, ONOFF_STOP_FILE=stop_file, ONOFF_ATTEMPT=1),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            reported = []
            for line in proc.stdout:
                if line.startswith("ONOFF_ITEMS "):
                    reported.append(int(line.split()[1]))
                    if reported[-1] == 5:
                        interrupt(proc, stop_file)
            rc = proc.wait(timeout=TIMEOUT)
            stderr = proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        self.assertEqual(rc, 143, stderr)
        stopped_at = reported[-1]
        self.assertGreaterEqual(stopped_at, 5)
        self.assertLess(stopped_at, total, "the run finished before the interruption took effect")
        self.assertEqual(reported, list(range(1, stopped_at + 1)))
        self.assertEqual(numbered(ckpt1), [str(stopped_at)], "the stop checkpoint, older ones deleted")
        self.assertEqual(sorted(os.listdir(ckpt1)), [str(stopped_at)], "no temporary or old dir left")

        resume = os.path.join(ckpt1, str(stopped_at))
        ckpt2 = self.mkdir("ckpt2")
        out = self.path("result.json")
        p = run_job([*args, "--output", out], ONOFF_CHECKPOINT_DIR=ckpt2, ONOFF_RESUME_DIR=resume, ONOFF_ATTEMPT=1)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn(f"resumed from checkpoint at item {stopped_at}", p.stderr)
        self.assertEqual(items_reported(p.stdout), list(range(stopped_at, total + 1)))
        self.assertEqual(result_digest(p.stdout), result_digest(full.stdout))
        with open(out) as f:
            self.assertEqual(json.load(f)["items"], total)
        # checkpoint numbers keep growing across attempts
        self.assertTrue(all(int(n) > stopped_at for n in numbered(ckpt2)), numbered(ckpt2))

    def test_stop_file_then_resume_gives_same_digest(self):
        def touch(proc, stop_file):
            with open(stop_file, "w"):
                pass

        self.interrupt_and_resume(touch)

    def test_sigterm_then_resume_gives_same_digest(self):
        self.interrupt_and_resume(lambda proc, stop_file: proc.send_signal(signal.SIGTERM))

    def test_stop_before_any_progress_writes_no_checkpoint(self):
        ckpt, stop_file = self.mkdir("ckpt"), self.path("stop")
        with open(stop_file, "w"):
            pass
        p = run_job(["--items", 5, "--size", SIZE], ONOFF_CHECKPOINT_DIR=ckpt, ONOFF_STOP_FILE=stop_file)
        self.assertEqual(p.returncode, 143)
        self.assertEqual(os.listdir(ckpt), [])

    def test_resume_refuses_other_size_or_items(self):
        ckpt = self.mkdir("ckpt")
        p = run_job(["--items", 10, "--size", SIZE, "--checkpoint-every", 5, "--fail-at", 7],
                    ONOFF_CHECKPOINT_DIR=ckpt)
        self.assertEqual(p.returncode, 3)
        resume = os.path.join(ckpt, "5")
        other_size = run_job(["--items", 10, "--size", SIZE + 1], ONOFF_RESUME_DIR=resume)
        self.assertEqual(other_size.returncode, 2)
        self.assertIn("--size", other_size.stderr)
        other_items = run_job(["--items", 10, "--size", SIZE, "--seed", 1], ONOFF_RESUME_DIR=resume)
        self.assertEqual(other_items.returncode, 2)
        empty = self.mkdir("empty")  # a resume dir without state.json: start over
        fresh = run_job(["--items", 3, "--size", SIZE], ONOFF_RESUME_DIR=empty)
        self.assertEqual(fresh.returncode, 0, fresh.stderr)
        self.assertEqual(result_digest(fresh.stdout), expected_digest(range(3), SIZE))

    def test_fail_at_exits_nonzero_and_retry_resumes(self):
        ckpt = self.mkdir("ckpt")
        args = ["--items", 10, "--size", SIZE, "--checkpoint-every", 2, "--fail-at", 5, "--fail-attempts", 1]
        p = run_job(args, ONOFF_CHECKPOINT_DIR=ckpt, ONOFF_ATTEMPT=1)
        self.assertEqual(p.returncode, 3)
        self.assertEqual(items_reported(p.stdout), [1, 2, 3, 4, 5])
        self.assertNotIn("ONOFF_RESULT", p.stdout)
        self.assertEqual(numbered(ckpt), ["4"])
        # attempt 2 is past --fail-attempts: it resumes from checkpoint 4 and succeeds
        retry = run_job(args, ONOFF_CHECKPOINT_DIR=self.mkdir("ckpt2"), ONOFF_RESUME_DIR=os.path.join(ckpt, "4"),
                        ONOFF_ATTEMPT=2)
        self.assertEqual(retry.returncode, 0, retry.stderr)
        self.assertEqual(result_digest(retry.stdout), expected_digest(range(10), SIZE))
        # without --fail-attempts every attempt fails
        always = run_job(["--items", 10, "--size", SIZE, "--fail-at", 0], ONOFF_ATTEMPT=9)
        self.assertEqual(always.returncode, 3)


if __name__ == "__main__":
    unittest.main()
