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
then the same summed by kernel name. Needs Python 3 alone.
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


def read_kernels(path):
    """[(name, ns, grid, block)] in launch order."""
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
    unit = rows[start + 1][col["gpu__time_duration.sum"]]
    scale = {"ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}.get(unit, 1.0)
    kernels = []
    for r in rows[start + 2:]:
        if len(r) != len(header):
            continue
        ns = float(r[col["gpu__time_duration.sum"]].replace(",", "")) * scale
        kernels.append((short_name(r[col["Kernel Name"]]), ns, r[col.get("Grid Size", 0)], r[col.get("Block Size", 0)]))
    return kernels


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --csv --page raw output with gpu__time_duration.sum")
    parser.add_argument("--step-end", default="summarize_kernel", help="the kernel that ends a step")
    args = parser.parse_args()

    kernels = read_kernels(args.csv)
    ends = [i for i, k in enumerate(kernels) if k[0].startswith(args.step_end)]
    if len(ends) < 2:
        sys.exit(f"fewer than two '{args.step_end}' launches: no whole step to show")
    step = kernels[ends[-2] + 1:ends[-1] + 1]
    total = sum(k[1] for k in step)
    print(f"last whole step: {len(step)} kernels, {total / 1e3:.1f} us")
    for name, ns, grid, block in step:
        print(f"{ns / 1e3:9.1f} us  {grid:>14} {block:>14}  {name}")
    print("\nby kernel:")
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for name, ns, _, _ in step:
        by_name[name][0] += 1
        by_name[name][1] += ns
    for name, (count, ns) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        print(f"{ns / 1e3:9.1f} us {100 * ns / total:5.1f}% {count:4d}x  {name}")


if __name__ == "__main__":
    main()
