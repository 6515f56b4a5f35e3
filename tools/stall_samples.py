#!/usr/bin/env python3
"""Where a kernel's warps wait, instruction by instruction, from ncu's source page.

On the GPU machine (the kernels of a decode step taken alone, each replayed for ncu's
full set of sections, which includes the warp-state sampling):

    ncu --clock-control none --set full --import-source no \\
        --kernel-name regex:"mma_linear|mma_pairs|mma_group" \\
        --launch-skip 150 --launch-count 10 -o prof \\
        keel bench --model flash4 --device cuda --prompt 64 --decode 8 --runs 1 --eager
    ncu -i prof.ncu-rep --page source --csv --print-source sass > source.csv
    python3 tools/stall_samples.py source.csv [--kernel N] [--top 25]

For each profiled launch the script prints its samples by stall reason and its
instructions grouped by how often each ran: the instructions a warp runs once (set-up
and epilogue) against those of its loops, and the samples each group holds. With
--kernel N (the launch's index in that list) it also prints that launch's hottest
instructions with their two main stall reasons, and with --mix the opcodes of each
group of its instructions that ran equally often (a loop body's make-up: e.g. 81 LOP3,
64 HMUL2, 32 HMMA in a 2 KiB MXFP4 step). Needs Python 3 alone.
"""

import argparse
import collections
import csv
import sys

from step_kernels import short_name

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_launches(path):
    """The launches in the CSV: [{'name', 'header', 'rows'}], in the file's order."""
    launches = []
    with open(path, newline="", errors="replace") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                launches.append({"name": row[1] if len(row) > 1 else "?", "header": None, "rows": []})
            elif row[0] == "Address" and launches:
                launches[-1]["header"] = row
            elif launches and launches[-1]["header"]:
                launches[-1]["rows"].append(row)
    # ncu prints some launches' tables twice in a row: keep one.
    kept = []
    for launch in launches:
        if launch["header"] and not (kept and kept[-1]["name"] == launch["name"] and kept[-1]["rows"] == launch["rows"]):
            kept.append(launch)
    return kept


def number(text):
    try:
        return int(text.replace(",", "")) if text else 0
    except ValueError:
        return 0


def stall_columns(header):
    """The per-reason sample columns (all samples, not the not-issued ones): name -> index."""
    return {name[len("stall_"):]: i for i, name in enumerate(header)
            if name.startswith("stall_") and "Not Issued" not in name}


def summarize(index, launch):
    header = launch["header"]
    col = {name: i for i, name in enumerate(header)}
    if SAMPLES not in col or EXECUTED not in col:
        print(f"[{index}] {short_name(launch['name'])}: no sampling columns (was --set full used?)")
        return
    reasons = stall_columns(header)
    by_reason = collections.Counter()
    total = executed = 0
    by_count = collections.defaultdict(lambda: [0, 0])  # times run -> [instructions, samples]
    for row in launch["rows"]:
        samples, runs = number(row[col[SAMPLES]]), number(row[col[EXECUTED]])
        total += samples
        executed += runs
        if runs:
            by_count[runs][0] += 1
            by_count[runs][1] += samples
        for reason, i in reasons.items():
            by_reason[reason] += number(row[i])
    print(f"[{index}] {short_name(launch['name'])}")
    print(f"    {total} samples, {executed:,} warp instructions executed")
    shares = ", ".join(f"{reason} {count * 100 / max(total, 1):.0f}%" for reason, count in by_reason.most_common(8))
    print(f"    stalls: {shares}")
    for runs, (instructions, samples) in sorted(by_count.items()):
        if instructions >= 4 or samples * 100 >= total:
            print(f"    run {runs:>9,} times: {instructions:5} instructions, {samples * 100 / max(total, 1):5.1f}% of samples")


def hottest(launch, top):
    header = launch["header"]
    col = {name: i for i, name in enumerate(header)}
    reasons = stall_columns(header)
    rows = sorted(launch["rows"], key=lambda row: -number(row[col[SAMPLES]]))
    total = sum(number(row[col[SAMPLES]]) for row in launch["rows"])
    print("    hottest instructions (share of samples, runs, main stalls, SASS):")
    for row in rows[:top]:
        samples = number(row[col[SAMPLES]])
        if samples == 0:
            break
        main = sorted(((number(row[i]), reason) for reason, i in reasons.items()), reverse=True)[:2]
        why = " ".join(f"{reason}:{count}" for count, reason in main if count)
        print(f"    {samples * 100 / max(total, 1):5.1f}% {number(row[col[EXECUTED]]):>9,}  {why:28} {row[1].strip()[:80]}")


def opcode(sass):
    """An instruction's opcode without its predicate and modifiers: '@!P0 LDS.U.128 ...' -> 'LDS'."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def mix(launch):
    header = launch["header"]
    col = {name: i for i, name in enumerate(header)}
    groups = collections.defaultdict(collections.Counter)  # times run -> opcode -> instructions
    for row in launch["rows"]:
        runs = number(row[col[EXECUTED]])
        if runs:
            groups[runs][opcode(row[1].strip())] += 1
    print("    opcodes of the instructions run equally often (groups of 8 or more):")
    for runs, ops in sorted(groups.items()):
        if sum(ops.values()) >= 8:
            listed = ", ".join(f"{count} {op}" for op, count in ops.most_common(10))
            print(f"    run {runs:>9,} times: {sum(ops.values()):4} = {listed}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--kernel", type=int, help="also list this launch's hottest instructions")
    parser.add_argument("--top", type=int, default=25, help="how many hottest instructions (default 25)")
    parser.add_argument("--mix", action="store_true", help="with --kernel: the opcodes of each group of equal runs")
    args = parser.parse_args()
    launches = read_launches(args.csv)
    if not launches:
        sys.exit(f"{args.csv}: no launches with a source table")
    for index, launch in enumerate(launches):
        summarize(index, launch)
        if index == args.kernel:
            hottest(launch, args.top)
            if args.mix:
                mix(launch)


if __name__ == "__main__":
    main()
