#!/usr/bin/env python3
"""Make the small real-data slices shipped in data/ (see data/README.md).

Usage (from the repository root):

    python3 data/make_slices.py [SHARED_DATA_DIR]

SHARED_DATA_DIR defaults to ../shared/data relative to the repository root. Only the Python standard
library is used and the output is deterministic: the same input gives byte-identical files.
"""

import csv
import datetime as dt
import hashlib
import json
import shutil
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent  # <repo>/data
REPO = DATA.parent
REGIONS = ("us-east-1", "us-west-2", "eu-west-1")

WEEK_DAYS = 7
MIN_WEEK_JOBS = 3000
SHORT_WINDOW_H = 6
SHORT_JOBS = 200
AZURE_MINUTES = 10


def read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    rows = [r for r in rows if r]  # philly.csv ends with an empty line
    return rows[0], rows[1:]


def write_csv(path, header, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(header)
        w.writerows(rows)


def philly_time(s):
    return dt.datetime.strptime(s, "%Y-%m-%d %H:%M:%S")


def azure_ticks(s):
    """'2023-11-16 18:17:03.9799600' -> integer 100 ns ticks since the epoch (exact, no float rounding)."""
    date_time, _, frac = s.partition(".")
    t = dt.datetime.strptime(date_time, "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.timezone.utc)
    frac = (frac + "0000000")[:7]
    return int(t.timestamp()) * 10_000_000 + int(frac)


def gpu_hours(rows, i_gpu_time):
    return sum(float(r[i_gpu_time]) for r in rows) / 3600.0


def philly(src, out):
    header, rows = read_csv(src / "philly_pollux" / "philly.csv")
    assert header == ["timestamp", "duration", "num_gpus", "gpu_time", "cluster"], header
    i_ts, i_gt = header.index("timestamp"), header.index("gpu_time")
    # Stable sort: ties keep the original row order.
    rows = sorted(rows, key=lambda r: philly_time(r[i_ts]))
    times = [philly_time(r[i_ts]) for r in rows]

    # 1. The 7-day window starting at a midnight with the highest total gpu_time submitted
    #    (at least MIN_WEEK_JOBS jobs). Ties go to the earliest start.
    first_day = dt.datetime.combine(times[0].date(), dt.time())
    last_day = dt.datetime.combine(times[-1].date(), dt.time())
    best = None
    day = first_day
    while day <= last_day:
        end = day + dt.timedelta(days=WEEK_DAYS)
        sel = [r for r, t in zip(rows, times) if day <= t < end]
        if len(sel) >= MIN_WEEK_JOBS:
            g = sum(float(r[i_gt]) for r in sel)
            if best is None or g > best[0]:
                best = (g, day, end, sel)
        day += dt.timedelta(days=1)
    _, wk_start, wk_end, week = best
    write_csv(out / "philly" / "philly-busy-week.csv", header, week)

    # 2. The whole-hour-aligned 6-hour window inside the week with the most jobs submitted
    #    (ties: earliest); keep its first SHORT_JOBS jobs by timestamp.
    wtimes = [philly_time(r[i_ts]) for r in week]
    best6 = None
    start = wk_start
    while start + dt.timedelta(hours=SHORT_WINDOW_H) <= wk_end:
        end = start + dt.timedelta(hours=SHORT_WINDOW_H)
        n = sum(1 for t in wtimes if start <= t < end)
        if best6 is None or n > best6[0]:
            best6 = (n, start, end)
        start += dt.timedelta(hours=1)
    n6, s6, e6 = best6
    short = [r for r, t in zip(week, wtimes) if s6 <= t < e6][:SHORT_JOBS]
    assert len(short) == SHORT_JOBS
    write_csv(out / "philly" / "philly-short.csv", header, short)

    shutil.copyfile(src / "philly_pollux" / "LICENSE_adaptdl_Apache-2.0.txt",
                    out / "philly" / "LICENSE_adaptdl_Apache-2.0.txt")
    print(f"philly-busy-week.csv: window [{wk_start}, {wk_end}) jobs={len(week)} "
          f"gpu_hours={gpu_hours(week, i_gt):.1f} first={week[0][i_ts]} last={week[-1][i_ts]}")
    print(f"philly-short.csv: 6-h window [{s6}, {e6}) jobs_in_window={n6} kept={len(short)} "
          f"gpu_hours={gpu_hours(short, i_gt):.1f} first={short[0][i_ts]} last={short[-1][i_ts]}")


def azure(src, out):
    header, rows = read_csv(src / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv")
    assert header == ["TIMESTAMP", "ContextTokens", "GeneratedTokens"], header
    ticks = [azure_ticks(r[0]) for r in rows]
    t0 = min(ticks)
    limit = t0 + AZURE_MINUTES * 60 * 10_000_000
    # Keep the original row order (the file is already in time order).
    sel = [r for r, t in zip(rows, ticks) if t < limit]
    write_csv(out / "azure" / "azure-code-10min.csv", header, sel)
    shutil.copyfile(src / "azure_llm_2023" / "LICENSE_CC-BY-4.0.txt", out / "azure" / "LICENSE_CC-BY-4.0.txt")
    print(f"azure-code-10min.csv: requests={len(sel)} first={sel[0][0]} last={sel[-1][0]} "
          f"context_tokens={sum(int(r[1]) for r in sel)} generated_tokens={sum(int(r[2]) for r in sel)}")


def catalog(src, out):
    cat = src / "aws_gpu_instance_catalog"
    (out / "catalog").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cat / "gpu_instance_specs.csv", out / "catalog" / "gpu_instance_specs.csv")

    header, rows = read_csv(cat / "gpu_instance_linux_prices_by_region.csv")
    i_preg = header.index("region")
    prices = [r for r in rows if r[i_preg] in REGIONS]
    write_csv(out / "catalog" / "prices-us-east-1.csv", header, prices)

    header, rows = read_csv(src / "aws_spot_advisor" / "spot_advisor_gpu_long.csv")
    i_snap, i_region, i_os = (header.index(c) for c in ("snapshot_commit_date", "region", "os"))
    newest = max(r[i_snap] for r in rows)  # ISO dates compare as strings
    adv = [r for r in rows if r[i_snap] == newest and r[i_os] == "Linux" and r[i_region] in REGIONS]
    write_csv(out / "catalog" / "spot-advisor-gpu.csv", header, adv)
    shutil.copyfile(src / "aws_spot_advisor" / "LICENSE_spotinfo_Apache-2.0.txt",
                    out / "catalog" / "LICENSE_spotinfo_Apache-2.0.txt")
    by_region = {reg: sum(1 for r in prices if r[i_preg] == reg) for reg in REGIONS}
    print(f"prices-us-east-1.csv: rows={len(prices)} by region={by_region}")
    print(f"spot-advisor-gpu.csv: snapshot={newest} rows={len(adv)}")


def skypilot(src, out):
    """The four 1-node AWS V100 preemption series (us-east-1c/1f, us-west-2b/2c): metadata and data
    as upstream, written compactly; the per-tick "prices" of three of them are left out (the
    simulator prices spot from the catalogue)."""
    name = "aws-04-22-2023"
    folder = src / "skypilot_spot_traces" / "preemption" / "1-node" / name
    dest = out / "skypilot" / name
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(folder.glob("*.json")):
        raw = f.read_bytes()
        d = json.loads(raw)
        slim = {"metadata": d["metadata"], "data": d["data"]}
        (dest / f.name).write_text(json.dumps(slim, separators=(",", ":")) + "\n")
        data = d["data"]
        ones = sum(1 for v in data if v == 1)
        changes = sum(1 for a, b in zip(data, data[1:]) if a != b)
        print(f"skypilot/{name}/{f.name}: gap_seconds={d['metadata']['gap_seconds']} ticks={len(data)} "
              f"unavailable={ones / len(data):.3f} changes={changes} prices={'prices' in d} "
              f"source sha256={hashlib.sha256(raw).hexdigest()}")


def main():
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO.parent / "shared" / "data"
    src = src.resolve()
    if not (src / "philly_pollux" / "philly.csv").exists():
        sys.exit(f"no shared data at {src} (pass the directory holding philly_pollux/ etc. as argv[1])")
    philly(src, DATA)
    azure(src, DATA)
    catalog(src, DATA)
    skypilot(src, DATA)


if __name__ == "__main__":
    main()
