"""Tests of scripts/idle_cost.py on hand-made idle sessions and on template.yaml (run by scripts/test.sh)."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "idle_cost.py")
TEMPLATE = os.path.join(HERE, "..", "template.yaml")
sys.path.insert(0, HERE)
import idle_cost  # noqa: E402


def session(folder: str, runs: dict, calls: list, metric_lines: int = 0) -> None:
    """An idle session's run directory: the report's function runs, the call log, and
    `metric_lines` EMF lines of two metrics."""
    with open(os.path.join(folder, "report.json"), "w") as f:
        json.dump({"functions": [{"function": k, "invocations": v} for k, v in runs.items()]}, f)
    with open(os.path.join(folder, "calls.jsonl"), "w") as f:
        for principal, service, op in calls:
            f.write(json.dumps({"principal": principal, "service": service, "operation": op}) + "\n")
    if metric_lines:
        line = {"_aws": {"CloudWatchMetrics": [{"Metrics": [{"Name": "A"}, {"Name": "B"}]}]}}
        with open(os.path.join(folder, "control-plane-metrics.log"), "w") as f:
            for _ in range(metric_lines):
                f.write(json.dumps(line) + "\n")


class IdleCost(unittest.TestCase):
    def run_script(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)

    def test_the_templates_conditions_at_their_defaults(self) -> None:
        with open(TEMPLATE) as f:
            text = f.read()
        c = idle_cost.conditions_at_defaults(text)
        # MaxUsdPerHour "0", AlarmEmail "", UseReservedConcurrency "true", CreateDashboard "true".
        self.assertEqual(
            (c["HasBudget"], c["HasAlarmEmail"], c["ReserveConcurrency"], c["HasDashboard"]),
            (False, False, True, True),
        )
        # rate(1 minute): 730 hours of 60 runs.
        self.assertEqual(idle_cost.runs_per_month(text), 43_800)

    def test_calls_are_priced_per_run_and_the_cold_start_amortised(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            calls = [("reconciler", "dynamodb", "PutItem")] * 4 + [("reconciler", "dynamodb", "Scan")] * 8
            calls += [("reconciler", "sqs", "GetQueueAttributes")] * 4 + [("reconciler", "ec2", "DescribeSubnets")]
            calls += [("submitter", "dynamodb", "PutItem")] * 100  # not the reconciler's: left out
            session(d, {"reconciler": 4, "scaler": 0}, calls, metric_lines=4)
            out = self.run_script(d, "--runs-per-month", "1000000", "--template", TEMPLATE)
            self.assertEqual(out.returncode, 0, out.stderr)
            rows = {" ".join(l.split()[:2]): l.split() for l in out.stdout.splitlines()}
            # A million runs: a write each at $0.625 per million WRU, two scans at $0.125 per
            # million RRU, an SQS request at $0.40 per million, EC2 free.
            self.assertEqual(rows["dynamodb PutItem"][2:], ["1.00", "1,000,000", "0.625"])
            self.assertEqual(rows["dynamodb Scan"][2:], ["2.00", "2,000,000", "0.250"])
            self.assertEqual(rows["sqs GetQueueAttributes"][2:], ["1.00", "1,000,000", "0.400"])
            self.assertIn("(cold start, amortised)", " ".join(rows["ec2 DescribeSubnets"]))
            self.assertIn("custom metrics printed while idle: 2 (4 lines)", out.stdout)
            self.assertRegex(out.stdout, r"AWS calls above\s+1\.275")

    def test_a_session_that_was_not_idle_is_refused(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            session(d, {"reconciler": 5, "submit": 2}, [])
            out = self.run_script(d, "--template", TEMPLATE)
            self.assertNotEqual(out.returncode, 0)
            self.assertIn("not idle", out.stderr)
            session(d, {"reconciler": 1}, [])
            out = self.run_script(d, "--template", TEMPLATE)
            self.assertIn("serve longer", out.stderr)


if __name__ == "__main__":
    unittest.main()
