#!/usr/bin/env python3
"""Where a decode step's device time goes, kernel by kernel, from an ncu CSV.

On the GPU machine (ncu times each kernel alone; --eager keeps the kernels out of CUDA
graphs, whose nodes ncu would otherwise profile as one):

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \\
        --log-file step.csv keel bench --model flash4 --device cuda \\
        --prompt 64 --decode 12 --runs 1 --eager
    python3 tools/step_kernels.py step.csv

A step is taken to end with the sampler's kernel (`summarize_kernel`), so the script
prints the last whole step: its kernels in launch order with their durations and grids,
then the same summed by kernel name, then by part of the step (cut before each mHC site
input and hc_head's first kernel: a sublayer a part). With `dram__bytes_read.sum` among
ncu's metrics (`--metrics gpu__time_duration.sum,dram__bytes_read.sum`) it adds what each
kernel read from memory and at what rate: ncu flushes the caches before each kernel, so
that is the kernel's weights and whatever else it reads, as a decode step's weights
would come. With --launches REGEX it prints instead, one a line, the ncu arguments that
profile that step's launches whose names REGEX finds in a second run of the same command
(`--kernel-name regex:REGEX --launch-skip N --launch-count M`: ncu counts only the
launches its filter takes). tools/profile_step.sh runs both passes.
Needs Python 3 alone.
"""

import argparse
import collections
import csv
import re
import sys


def short_name(name):
    """The kernel's name without namespaces and parameter lists."""
    name = re.sub(r"\(anonymous namespace\)::|<?unnamed>::|keel::cuda::|keel::", "", name)
    name = re.sub(r"^void ", "", name)
    depth, out = 0, []
    for ch in name:  # drop the parameter list, keep template arguments
        if ch == "(" and depth == 0:
            break
        depth += ch == "<"
        depth -= ch == ">"
        out.append(ch)
    return "".join(out)


BYTES = "dram__bytes_read.sum"
BYTE_UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def read_kernels(path):
    """[(name, ns, grid, block, bytes or None)] in launch order."""
    with open(path, newline="", errors="replace") as f:
        rows = list(csv.reader(f))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
    if start is None:
        sys.exit(f"{path}: no ncu raw-page header (an 'ID' column) found")
    header = rows[start]
    col = {h: i for i, h in enumerate(header)}
    for needed in ("Kernel Name", "gpu__time_duration.sum"):
        if needed not in col:
            sys.exit(f"{path}: no '{needed}' column (run ncu with --metrics gpu__time_duration.sum --page raw)")
    units = rows[start + 1]
    scale = {"ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}.get(units[col["gpu__time_duration.sum"]], 1.0)
    byte_scale = BYTE_UNITS.get(units[col[BYTES]], 1) if BYTES in col else None
    kernels = []
    for r in rows[start + 2:]:
        if len(r) != len(header):
            continue
        ns = float(r[col["gpu__time_duration.sum"]].replace(",", "")) * scale
        read = float(r[col[BYTES]].replace(",", "")) * byte_scale if byte_scale else None
        kernels.append((short_name(r[col["Kernel Name"]]), ns, r[col.get("Grid Size", 0)], r[col.get("Block Size", 0)],
                        read))
    return kernels


def traffic(read, ns):
    """' 12.3 MiB 1.23 TB/s' for a kernel that read `read` bytes in `ns`, or ''."""
    if read is None:
        return ""
    return f" {read / 2**20:8.1f} MiB {read / ns / 1e3:5.2f} TB/s"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --csv --page raw output with gpu__time_duration.sum")
    parser.add_argument("--step-end", default="summarize_kernel", help="the kernel that ends a step")
    parser.add_argument("--part-start", default="site_in,mix_dots",
                        help="kernels that begin a part of the step, comma-separated (default: each mHC site input, "
                             "so a part is a sublayer, and hc_head's first kernel; empty: no parts)")
    parser.add_argument("--launches", metavar="REGEX",
                        help="print the ncu arguments that select the last whole step's launches REGEX finds")
    args = parser.parse_args()

    kernels = read_kernels(args.csv)
    ends = [i for i, k in enumerate(kernels) if k[0].startswith(args.step_end)]
    if len(ends) < 2:
        sys.exit(f"fewer than two '{args.step_end}' launches: no whole step to show")
    if args.launches:
        return print_launches(kernels, ends[-2] + 1, ends[-1] + 1, args.launches)
    step = kernels[ends[-2] + 1:ends[-1] + 1]
    total = sum(k[1] for k in step)
    measured = all(k[4] is not None for k in step)
    read = sum(k[4] for k in step) if measured else None
    print(f"last whole step: {len(step)} kernels, {total / 1e3:.1f} us{traffic(read, total)}")
    for name, ns, grid, block, bytes_read in step:
        print(f"{ns / 1e3:9.1f} us  {grid:>14} {block:>14}{traffic(bytes_read, ns)}  {name}")
    print("\nby kernel:")
    by_name = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for name, ns, _, _, bytes_read in step:
        by_name[name][0] += 1
        by_name[name][1] += ns
        by_name[name][2] += bytes_read or 0.0
    for name, (count, ns, bytes_read) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        print(f"{ns / 1e3:9.1f} us {100 * ns / total:5.1f}% {count:4d}x{traffic(bytes_read if measured else None, ns)}  {name}")
    starts = [name for name in args.part_start.split(",") if name]
    if starts:
        print_parts(step, total, measured, starts)


def print_launches(kernels, first, end, regex):
    """ncu's filter for the launches of kernels[first:end] whose names `regex` finds."""
    found = [bool(re.search(regex, k[0])) for k in kernels]
    count = sum(found[first:end])
    if count == 0:
        sys.exit(f"no launch of the last whole step matches {regex!r}")
    print("--kernel-name", f"regex:{regex}", "--launch-skip", sum(found[:first]), "--launch-count", count, sep="\n")


def print_parts(step, total, measured, starts):
    """The step cut before each launch of a kernel named in `starts`: each part's launches,
    time and reads (with the default, an attention or MoE sublayer apiece)."""
    parts = []
    for kernel in step:
        if not parts or any(kernel[0].startswith(name) for name in starts):
            parts.append([])
        parts[-1].append(kernel)
    print(f"\nby part (a new one at each {', '.join(starts)}):")
    for i, part in enumerate(parts):
        ns = sum(k[1] for k in part)
        read = sum(k[4] for k in part) if measured else None
        print(f"{i:4d} {ns / 1e3:9.1f} us {100 * ns / total:5.1f}% {len(part):4d}x{traffic(read, ns)}  "
              f"from {part[0][0]}")


if __name__ == "__main__":
    main()
