#!/usr/bin/env python3
"""What a deployed onoff stack costs a month while no job comes, from a measured idle run.

Usage:
    python3 scripts/idle_cost.py RUN_DIR [--template template.yaml] [--runs-per-month N]
        [--run-s S] [--memory-mb M]

`scripts/run.sh idle-cost [SECONDS]` serves such a session and runs this on it. RUN_DIR is the
run directory of an idle `onoff local --serve --json` session (its `calls.jsonl`:
every AWS call, with the principal that made it, and `report.json`: the session's `--json`
report, whose `functions` give the reconciler's invocations). The reconciler runs on its schedule
whether or not work comes; with nothing queued nothing else runs (no alarm fires, no agent lives).
Each AWS call the reconciler made is counted per invocation and priced; calls made fewer times
than there were invocations (a cold start's lookups) are amortised over the session, so a longer
session gives the steady figure.

The rest of the always-on bill comes from template.yaml at its parameters' defaults: its
CloudWatch alarms (priced per metric each reads), its dashboard, and the custom metrics the functions print (none while idle since the
fleet metrics are printed only for a fleet or a run that acted; the agent prints its own per job).

Prices: us-east-1 list prices, USD (AWS pricing pages: AWS Lambda, Amazon DynamoDB on-demand,
Amazon SQS, Amazon CloudWatch). Free tiers are left out: they are per account, shared with
whatever else the account runs. Lambda's duration on AWS is not measured here (the local runs
call moto, not AWS): `--run-s` (default 0.5 s) is an assumption, and the table also gives the
bound at the function's 60 s timeout.
"""

import argparse
import collections
import json
import os
import re
import sys

# USD, us-east-1.
LAMBDA_PER_REQUEST = 0.20 / 1e6  # AWS Lambda pricing: $0.20 per 1M requests
LAMBDA_ARM_PER_GB_S = 0.0000133334  # AWS Lambda pricing: Arm, first 7.5 B GB-s
DYNAMODB_PER_WRU = 0.625 / 1e6  # Amazon DynamoDB pricing, on-demand (since 2024-11-01)
DYNAMODB_PER_RRU = 0.125 / 1e6
SQS_PER_REQUEST = 0.40 / 1e6  # Amazon SQS pricing: standard queues, per 1M requests
CW_ALARM_METRIC_MONTH = 0.10  # Amazon CloudWatch pricing: standard-resolution alarm, per metric
CW_DASHBOARD_MONTH = 3.00  # Amazon CloudWatch pricing: per dashboard (beyond the free three)
CW_CUSTOM_METRIC_MONTH = 0.30  # Amazon CloudWatch pricing: first 10,000 metrics
HOURS_PER_MONTH = 730.0

DYNAMODB_WRITES = {"PutItem", "UpdateItem", "DeleteItem", "BatchWriteItem", "TransactWriteItems"}
DYNAMODB_READS = {"GetItem", "Query", "Scan", "BatchGetItem", "TransactGetItems"}


def runs_per_month(template_text):
    """Reconciler runs a month at the template's default ReconcileSchedule (rate(N minutes))."""
    m = re.search(r"ReconcileSchedule:\s*\n(?:\s+\w+:.*\n)*?\s+Default:\s*rate\((\d+) minutes?\)", template_text)
    if not m:
        sys.exit("template.yaml: no ReconcileSchedule default of the form rate(N minutes)")
    return HOURS_PER_MONTH * 60.0 / int(m.group(1))


def parameter_defaults(template_text):
    """Each parameter's Default, as text."""
    params = template_text.split("\nParameters:\n", 1)[1].split("\nConditions:\n", 1)[0]
    out, name = {}, None
    for line in params.splitlines():
        m = re.match(r"  (\w+):$", line)
        if m:
            name = m.group(1)
            continue
        d = re.match(r"    Default: (.*)$", line)
        if d and name:
            out[name] = d.group(1).strip().strip('"')
    return out


def conditions_at_defaults(template_text):
    """The template's conditions of the forms `!Equals [!Ref P, "v"]` and
    `!Not [!Equals [!Ref P, "v"]]`, evaluated at the parameters' defaults; others are left out."""
    defaults = parameter_defaults(template_text)
    block = template_text.split("\nConditions:\n", 1)[1].split("\n\n", 1)[0]
    out = {}
    for line in block.splitlines():
        m = re.match(r'\s+(\w+): (!Not \[)?!Equals \[!Ref (\w+), "([^"]*)"\]', line)
        if m:
            equal = defaults.get(m.group(3)) == m.group(4)
            out[m.group(1)] = equal != bool(m.group(2))
    return out


def resources(template_text, type_name):
    """The resource blocks of `type_name`, each with its Condition (None for none)."""
    blocks = re.split(r"\n  (?=[A-Za-z0-9]+:\n)", template_text.split("\nResources:\n", 1)[1])
    for b in blocks:
        if f"Type: {type_name}" in b:
            c = re.search(r"\n    Condition: (\w+)", b)
            yield b, c.group(1) if c else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--template", default=os.path.join(os.path.dirname(__file__), "..", "template.yaml"))
    ap.add_argument("--runs-per-month", type=float, help="default: the template's ReconcileSchedule")
    ap.add_argument("--run-s", type=float, default=0.5, help="assumed duration of an idle run on AWS, s")
    ap.add_argument("--memory-mb", type=float, default=256.0, help="the functions' MemorySize")
    a = ap.parse_args()

    with open(a.template) as f:
        template = f.read()
    with open(os.path.join(a.run_dir, "report.json")) as f:
        report = json.load(f)
    runs = {f["function"]: f["invocations"] for f in report["functions"]}
    n = runs.get("reconciler", 0)
    if n < 2:
        sys.exit(f"{a.run_dir}: the reconciler ran {n} time(s); serve longer")
    busy = {k: v for k, v in runs.items() if k != "reconciler" and v}
    if busy:
        sys.exit(f"{a.run_dir}: not idle, other functions ran: {busy}")

    calls = collections.Counter()
    with open(os.path.join(a.run_dir, "calls.jsonl")) as f:
        for line in f:
            c = json.loads(line)
            if c.get("principal") == "reconciler":
                calls[(c["service"], c["operation"])] += 1

    month = a.runs_per_month or runs_per_month(template)
    rows = []
    print(f"idle session: {n} reconciler runs; priced at {month:,.0f} runs a month")
    print(f"{'AWS call (reconciler)':40} {'per run':>8}  {'a month':>12}  {'$ a month':>9}")
    per_call_total = 0.0
    for (service, op), k in sorted(calls.items()):
        per_run = k / n
        monthly = per_run * month
        if service == "dynamodb" and op in DYNAMODB_WRITES:
            usd = monthly * DYNAMODB_PER_WRU  # an item under 1 KB: 1 WRU
        elif service == "dynamodb" and op in DYNAMODB_READS:
            usd = monthly * DYNAMODB_PER_RRU  # at most 1 RRU for an item or page under 4 KB
        elif service == "sqs":
            usd = monthly * SQS_PER_REQUEST
        else:
            usd = 0.0  # EC2 and STS calls are not billed
        per_call_total += usd
        note = "" if k >= n else "  (cold start, amortised)"
        print(f"{service + ' ' + op:40} {per_run:8.2f}  {monthly:12,.0f}  {usd:9.3f}{note}")
    gb_s = a.memory_mb / 1024.0
    lambda_usd = month * (LAMBDA_PER_REQUEST + a.run_s * gb_s * LAMBDA_ARM_PER_GB_S)
    lambda_bound = month * (LAMBDA_PER_REQUEST + 60.0 * gb_s * LAMBDA_ARM_PER_GB_S)
    # At the parameters' defaults: a resource whose condition is false there is not created.
    conditions = conditions_at_defaults(template)
    created = lambda c: c is None or conditions.get(c, True)
    alarms, alarm_metric_count, left_out = 0, 0, []
    for b, c in resources(template, "AWS::CloudWatch::Alarm"):
        if not created(c):
            left_out.append(c)
            continue
        alarms += 1
        stats = b.count("MetricStat:")
        alarm_metric_count += stats if stats else 1  # a metric-math alarm: each metric it reads
    alarm_usd = alarm_metric_count * CW_ALARM_METRIC_MONTH
    dashboards = sum(1 for _, c in resources(template, "AWS::CloudWatch::Dashboard") if created(c))
    dash_usd = dashboards * CW_DASHBOARD_MONTH
    metric_lines = 0
    metrics_log = os.path.join(a.run_dir, "control-plane-metrics.log")
    metric_names = set()
    if os.path.exists(metrics_log):
        with open(metrics_log) as f:
            for line in f:
                metric_lines += 1
                for m in json.loads(line)["_aws"]["CloudWatchMetrics"]:
                    metric_names.update(x["Name"] for x in m["Metrics"])
    metrics_usd = len(metric_names) * CW_CUSTOM_METRIC_MONTH if metric_lines else 0.0
    print()
    print(f"{'item':58} {'$ a month':>9}")
    print(f"{'AWS calls above':58} {per_call_total:9.3f}")
    print(f"{f'Lambda: {month:,.0f} runs of {a.run_s} s at {a.memory_mb:.0f} MB (arm64)':58} {lambda_usd:9.3f}")
    print(f"{f'  (bound: every run at the 60 s timeout)':58} {lambda_bound:9.3f}")
    unmade = f", not {', '.join(left_out)}" if left_out else ""
    print(f"{f'CloudWatch alarms: {alarms} reading {alarm_metric_count} metrics{unmade}':58} {alarm_usd:9.3f}")
    print(f"{f'CloudWatch dashboards: {dashboards}':58} {dash_usd:9.3f}")
    print(f"{f'custom metrics printed while idle: {len(metric_names)} ({metric_lines} lines)':58} {metrics_usd:9.3f}")
    total = per_call_total + lambda_usd + alarm_usd + dash_usd + metrics_usd
    print(f"{'total':58} {total:9.2f}")


if __name__ == "__main__":
    main()
