#!/usr/bin/env python3
"""Share of a Philly-format trace's jobs that no recent-past forecast can have ready.

Counts arrivals per (390 s window, GPUs per job) and, for each look-back, the jobs by which a
window exceeds the largest window of the same shape in the look-back before it: those jobs arrive
beyond anything the predictive warm pool has seen lately, so they wait a cold start. README.md
quotes the output for ../shared/data/philly_pollux/philly.csv (issue 12's p95 target).

Usage: python3 scripts/burst_share.py TRACE.csv [--window-s 390] [--lookback-h 3 12 48]
"""
import argparse
import collections
import csv
import datetime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="Philly-format CSV: timestamp,duration,num_gpus,gpu_time,cluster")
    ap.add_argument("--window-s", type=float, default=390.0, help="window, seconds (the cold-start estimate)")
    ap.add_argument("--lookback-h", type=float, nargs="+", default=[3.0, 12.0, 48.0], help="look-backs, hours")
    a = ap.parse_args()
    with open(a.trace, newline="") as f:
        arrivals = [
            (datetime.datetime.fromisoformat(r["timestamp"]).timestamp(), int(r["num_gpus"]))
            for r in csv.DictReader(f)
        ]
    per_window = collections.Counter((int(t // a.window_s), g) for t, g in arrivals)
    n = len(arrivals)
    for hours in a.lookback_h:
        windows = int(hours * 3600 // a.window_s) + 1
        beyond = 0
        for (k, g), c in per_window.items():
            seen = max((per_window.get((k - j, g), 0) for j in range(1, windows + 1)), default=0)
            beyond += max(0, c - seen)
        print(f"look-back {hours:g} h: {beyond} of {n} jobs ({100.0 * beyond / n:.1f} %) beyond the look-back's largest window")


if __name__ == "__main__":
    main()
