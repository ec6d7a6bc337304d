#!/usr/bin/env python3
"""How much longer one fleet makes a trace's jobs wait than another, per burst of arrivals.

Reads two `waits-POLICY.csv` files that `onoff simulate --out DIR` wrote for the same trace
(columns job,arrival_s,gpus,instances,run_s,wait_s; same jobs, same order) and prints, per burst
(arrivals closer than --gap-s to the one before), the jobs, their run time and the mean extra wait
of B over A, then the extra job-hours in all and after --after-s. Also prints the trace's longest
gap between arrivals. README.md quotes it for the Azure trace (issue 12's Azure target), A the
default run, B the one-worker config.

Usage: python3 scripts/wait_delta.py A/waits-onoff.csv B/waits-onoff.csv [--gap-s 30] [--after-s 700]
"""
import argparse
import csv


def read(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="waits CSV of the reference fleet")
    ap.add_argument("b", help="waits CSV of the fleet compared with it")
    ap.add_argument("--gap-s", type=float, default=30.0, help="a gap longer than this starts a burst, seconds")
    ap.add_argument("--after-s", type=float, default=700.0, help="also sum the bursts starting after this, seconds")
    args = ap.parse_args()
    a, b = read(args.a), read(args.b)
    if [r["job"] for r in a] != [r["job"] for r in b]:
        raise SystemExit("the two files do not hold the same jobs in the same order: not the same trace")
    arrival = [float(r["arrival_s"]) for r in a]
    run = [float(r["run_s"]) for r in a]
    extra = [float(rb["wait_s"]) - float(ra["wait_s"]) for ra, rb in zip(a, b)]
    if not arrival:
        raise SystemExit("no jobs")
    gaps = [(arrival[i + 1] - arrival[i], arrival[i]) for i in range(len(arrival) - 1)]
    if gaps:
        g, at = max(gaps)
        print(f"longest gap between arrivals: {g:.0f} s (after the arrival at {at:.0f} s)")
    print(f"{'burst at':>9} {'jobs':>6} {'run s':>7} {'mean extra wait s':>18} {'extra job-h':>12}")
    total = after = 0.0
    start = 0
    for i in range(1, len(arrival) + 1):
        if i < len(arrival) and arrival[i] - arrival[i - 1] <= args.gap_s:
            continue
        n = i - start
        job_h = sum(extra[start:i]) / 3600.0
        print(f"{arrival[start]:>9.0f} {n:>6} {sum(run[start:i]):>7.0f} {3600.0 * job_h / n:>18.1f} {job_h:>12.3f}")
        total += job_h
        if arrival[start] > args.after_s:
            after += job_h
        start = i
    print(f"extra job-hours of waiting: {total:.1f} in all, {after:.1f} in the bursts after {args.after_s:.0f} s")


if __name__ == "__main__":
    main()
