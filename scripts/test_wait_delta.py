"""Tests of scripts/wait_delta.py on hand-made waits files (run by scripts/test.sh)."""
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wait_delta.py")
HEADER = "job,arrival_s,gpus,instances,run_s,wait_s\n"


def write(folder: str, name: str, rows: list[tuple]) -> str:
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write(HEADER)
        for r in rows:
            f.write(",".join(str(x) for x in r) + "\n")
    return path


class WaitDelta(unittest.TestCase):
    def run_script(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)

    def test_bursts_extra_waits_and_totals(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            # Two bursts (0-10 s and 1000-1001 s); B waits 1800 s longer on job 1 and 3600 s on job 3.
            a = write(d, "a.csv", [(0, 0, 1, 1, 5, 0), (1, 10, 1, 1, 5, 0), (2, 1000, 1, 1, 2, 0), (3, 1001, 1, 1, 2, 1)])
            b = write(d, "b.csv", [(0, 0, 1, 1, 5, 0), (1, 10, 1, 1, 5, 1800), (2, 1000, 1, 1, 2, 0), (3, 1001, 1, 1, 2, 3601)])
            out = self.run_script(a, b, "--after-s", "500")
            self.assertEqual(out.returncode, 0, out.stderr)
            lines = out.stdout.splitlines()
            self.assertIn("longest gap between arrivals: 990 s (after the arrival at 10 s)", lines[0])
            self.assertEqual(lines[2].split(), ["0", "2", "10", "900.0", "0.500"])
            self.assertEqual(lines[3].split(), ["1000", "2", "4", "1800.0", "1.000"])
            self.assertEqual(lines[4], "extra job-hours of waiting: 1.5 in all, 1.0 in the bursts after 500 s")

    def test_files_of_different_traces_are_refused(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            a = write(d, "a.csv", [(0, 0, 1, 1, 5, 0)])
            b = write(d, "b.csv", [(1, 0, 1, 1, 5, 0)])
            out = self.run_script(a, b)
            self.assertNotEqual(out.returncode, 0)
            self.assertIn("not the same trace", out.stderr)


if __name__ == "__main__":
    unittest.main()
