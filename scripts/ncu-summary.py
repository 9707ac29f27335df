#!/usr/bin/env python3
"""Summarizes scripts/gpu-check.sh's Nsight Compute runs (OUTDIR/ncu-KIND.csv,
KIND = fast, staged, general, fast-int8, staged-int8, fast-lanes4): per
kernel, the median duration, DRAM bytes read and DRAM throughput of its
launches in the fp16 row (its first 8 launches) and in the 2-bit row (the
next 8); a kernel launched another number of times is summarized over all
its launches. Then OUTDIR/ncu-diag-KIND.csv (KIND = staged, fast,
staged-int8): instructions, issue activity, occupancy and stall reasons."""
import csv
import io
import os
import statistics
import sys

# Nsight Compute spells units differently by version.
TIME = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
        "second": 1e6, "s": 1e6}
BYTES = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "B": 1, "KB": 1e3, "MB": 1e6,
         "GB": 1e9}


def launches(path):
    """{launch id: (kernel name, {metric: value in us or bytes})}."""
    lines = [line for line in open(path) if line.startswith('"')]
    out = {}
    for r in csv.DictReader(io.StringIO("".join(lines))):
        try:
            v = float(r["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            continue
        unit, name = r.get("Metric Unit", ""), r["Metric Name"]
        if name == "gpu__time_duration.sum":
            v *= TIME.get(unit, 1.0)
        if name == "dram__bytes_read.sum":
            v *= BYTES.get(unit, 1.0)
        kernel = r.get("Kernel Name", "?").split("(")[0]
        out.setdefault(int(r["ID"]), (kernel, {}))[1][name] = v
    return out


def row_parts(kind, rows, needs=None):
    """(kernel, row label, its launches' metrics) per kernel (launches with
    metric `needs`, when given) and bench row: fp16 (the first 8 launches)
    and 2-bit (the next 8), else all the kernel's launches as one."""
    by_kernel = {}
    for i in sorted(rows):
        kernel, metrics = rows[i]
        if needs is None or needs in metrics:
            by_kernel.setdefault(kernel, []).append(metrics)
    arith = "int8" if kind.endswith("-int8") else "exact"
    for kernel, ms in by_kernel.items():
        parts = [("fp16", ms[:8]), (f"2-bit {arith}", ms[8:16])] if len(ms) == 16 else [
            (f"all {len(ms)}", ms)]
        for label, part in parts:
            yield kernel, label, part


def median(part, name, default=None):
    """The median of metric `name` over the launches that have it (or, with
    `default`, over all of them, `default` where one lacks it); NaN if none."""
    vals = [m.get(name, default) for m in part if default is not None or name in m]
    return statistics.median(vals) if vals else float("nan")


def summary(kind, rows):
    """One line per kernel and row of the bench."""
    for kernel, label, part in row_parts(kind, rows, "gpu__time_duration.sum"):
        us = median(part, "gpu__time_duration.sum")
        gb = median(part, "dram__bytes_read.sum", 0)
        pct = median(part, "dram__throughput.avg.pct_of_peak_sustained_elapsed", 0)
        rate = gb / us / 1e3 if us > 0 else 0.0
        print(f"  {kind:<11} {kernel:<18} {label:<12} {us:9.1f} us, DRAM read "
              f"{gb / 1e6:8.1f} MB ({rate:7.1f} GB/s), {pct:5.1f}% of peak "
              f"({len(part)} launches)")


STALL = "smsp__average_warps_issue_stalled_"


def diagnosis(kind, rows):
    """Per kernel and row (fp16: the first 8 launches, 2-bit: the next 8):
    warp instructions, issue activity, occupancy, cycles between a warp's
    issues and the stall reasons that make them up, largest first."""
    for kernel, label, part in row_parts(kind, rows):
        stalls = sorted(((median(part, n), n[len(STALL):].split("_per_issue")[0])
                         for n in part[0] if n.startswith(STALL)), reverse=True)
        print(f"  {kind:<11} {kernel:<18} {label:<12} "
              f"{median(part, 'sm__inst_executed.sum') / 1e6:7.1f} M warp instructions, "
              f"issue {median(part, 'smsp__issue_active.avg.per_cycle_active'):.2f}/cycle, "
              f"occupancy {median(part, 'sm__warps_active.avg.pct_of_peak_sustained_active'):.0f}%, "
              f"{median(part, 'smsp__average_warps_active_per_issue_active.ratio'):.1f} cycles/issue: "
              + ", ".join(f"{why} {v:.1f}" for v, why in stalls))


def main():
    out = sys.argv[1]
    for kind in ("fast", "staged", "general", "fast-int8", "staged-int8", "fast-lanes4"):
        path = os.path.join(out, f"ncu-{kind}.csv")
        if os.path.exists(path):
            summary(kind, launches(path))
    for kind in ("staged", "fast", "staged-int8"):
        path = os.path.join(out, f"ncu-diag-{kind}.csv")
        if os.path.exists(path):
            diagnosis(kind, launches(path))


if __name__ == "__main__":
    main()
