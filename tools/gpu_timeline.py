#!/usr/bin/env python3
"""Where a decode step's time goes on the GPU's timeline, from a tools/gpu_trace.cpp CSV.

A step is the GPU work between two copies back to the host (each forward call ends with
one: logits or sampling summaries). For each step: its span, the time some GPU work ran
(kernels, copies, memsets on any stream, overlaps counted once) and the idle rest, which
is split in two: host-late, where the next operation's API call had not yet been made
when the GPU went idle (the host set the pace), and the rest (launch latency, waiting
between streams, a graph's own gaps). Then, for the median step of the longest run of
steps alike (same operation count: a decode run), its largest gaps with the operations
either side, and its time by kernel name.

    python3 tools/gpu_timeline.py trace.csv [--gaps 25] [--min-ops 50] [--ops] [--step N]
    python3 tools/gpu_timeline.py trace.csv --own [--min-ops 50]
    python3 tools/gpu_timeline.py trace.csv --against other.csv [--min-ops 50]

With --step N, step N (as numbered in the first table) stands for the median step: a
batched decode run after a single one, say. With --ops, that step's operations follow in start order: start, end and length
(us from the step's first operation), stream and name, to read a layer's chain.

With --against, two builds' traces of the same run (a patch's A/B): for each, the decode
run's median span, then each operation's time a step (median over the run's steps) in
both, by how much it moved. An operation's time is its end after the operation before
it on its stream ended (or after its own start, if later): what it adds to that stream,
not counting a kernel's early launch waiting for the one before (PDL), but counting a
wait for another stream (the MoE's expand follows the side stream's down projection on
its stream and waits there for the routed experts': about 20 us of "expand" a layer).
With --own, the same times of one trace alone, largest first: where a decode step's
kernels spend their time, summed over the layers (on 2026-12-07 read by hand from --ops).
"""
import argparse
import collections
import csv
import re
import statistics
import sys

GPU_KINDS = ("kernel", "memcpy", "memset")
DTOH = "kind 2"  # CUPTI_ACTIVITY_MEMCPY_KIND_DTOH


def read(path):
    gpu, api = [], {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rec = (int(row["start_ns"]), int(row["end_ns"]), row["kind"], row["name"], int(row["correlation"]),
                   int(row["stream"]))
            if row["kind"] in GPU_KINDS:
                gpu.append(rec)
            elif rec[4]:
                api[rec[4]] = rec  # the call that enqueued the GPU record of the same correlation
    gpu.sort()
    return gpu, api


def steps_of(gpu):
    """GPU records cut after each copy back to the host."""
    steps, current = [], []
    for rec in gpu:
        current.append(rec)
        if rec[2] == "memcpy" and rec[3].endswith(DTOH):
            steps.append(current)
            current = []
    return steps


def analyse(step, api):
    """(span, busy, host-late idle, other idle, gaps) of one step; gaps: (length, before, after, host_late)."""
    start, end = step[0][0], max(r[1] for r in step)
    busy = late = other = 0
    gaps = []
    reach, prev = start, None
    for rec in step:
        if rec[0] > reach:
            gap = rec[0] - reach
            call = api.get(rec[4])
            host_late = call is not None and call[1] > reach  # its API call returned after the GPU went idle
            gaps.append((gap, prev, rec, host_late))
            if host_late:
                late += gap
            else:
                other += gap
        busy += max(0, rec[1] - max(rec[0], reach))
        if rec[1] > reach:
            reach, prev = rec[1], rec
    return end - start, busy, late, other, gaps


def decode_run(steps):
    """The indices of the longest run of consecutive steps with the same operation count."""
    best, run_start = (0, 0), 0
    for i in range(1, len(steps) + 1):
        if i == len(steps) or len(steps[i]) != len(steps[run_start]):
            if i - run_start > best[1] - best[0]:
                best = (run_start, i)
            run_start = i
    return range(*best)


def own_times(step):
    """{label: (ns, count)} of a step, each operation's end after its stream's previous one."""
    last_end, times = {}, collections.defaultdict(lambda: [0, 0])
    for rec in step:
        since = max(rec[0], last_end.get(rec[5], rec[0]))
        last_end[rec[5]] = max(last_end.get(rec[5], 0), rec[1])
        times[label(rec)][0] += max(0, rec[1] - since)
        times[label(rec)][1] += 1
    return times


def run_profile(path, min_ops):
    """(median span, {label: (median ns a step, count a step)}) of a trace's decode run."""
    gpu, _ = read(path)
    steps = [s for s in steps_of(gpu) if len(s) >= min_ops]
    if not steps:
        sys.exit(f"{path}: no step with enough GPU operations")
    run = [steps[i] for i in decode_run(steps)]
    per_step = [own_times(s) for s in run]
    labels = set().union(*per_step)
    profile = {n: (statistics.median(t[n][0] if n in t else 0 for t in per_step),
                   statistics.median(t[n][1] if n in t else 0 for t in per_step)) for n in labels}
    span = statistics.median(max(r[1] for r in s) - s[0][0] for s in run)
    return span, len(run), profile


def own(path, min_ops):
    span, steps, profile = run_profile(path, min_ops)
    print(f"median step span: {span / 1e3:.1f} us ({steps} steps)")
    print("\nus a step each operation adds to its stream (median over the run), count a step; largest first")
    for name, (t, count) in sorted(profile.items(), key=lambda kv: -kv[1][0]):
        print(f"  {t / 1e3:8.1f} {count:4g}  {name}")
    print(f"  {sum(t for t, _ in profile.values()) / 1e3:8.1f}       (all)")


def compare(a_path, b_path, min_ops):
    (span_a, n_a, a), (span_b, n_b, b) = run_profile(a_path, min_ops), run_profile(b_path, min_ops)
    print(f"median step span: A {span_a / 1e3:.1f} us ({n_a} steps), B {span_b / 1e3:.1f} us ({n_b} steps), "
          f"B - A {(span_b - span_a) / 1e3:+.1f} us ({100 * (span_b - span_a) / span_a:+.2f}%)")
    print("\nus a step (median over the run), count a step: A, B, B - A; largest moves first")
    rows = [(n, *a.get(n, (0, 0)), *b.get(n, (0, 0))) for n in set(a) | set(b)]
    for name, ta, ca, tb, cb in sorted(rows, key=lambda r: -abs(r[3] - r[1])):
        print(f"  {ta / 1e3:8.1f} {ca:4g}  {tb / 1e3:8.1f} {cb:4g}  {(tb - ta) / 1e3:+7.1f}  {name}")
    total_a, total_b = sum(t for t, _ in a.values()), sum(t for t, _ in b.values())
    print(f"  {total_a / 1e3:8.1f}       {total_b / 1e3:8.1f}       {(total_b - total_a) / 1e3:+7.1f}  (all)")


def label(rec):
    if rec is None:
        return "-"
    name = rec[3] if rec[2] == "kernel" else f"{rec[2]} {rec[3]}"
    # A mangled kernel name without its namespace and file prefix: keel::cuda::(anonymous)::
    name = re.sub(r"^_ZN4keel4cuda\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]+\d+", "", name)
    return name[:70]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--gaps", type=int, default=25, help="largest gaps of the median step to list")
    ap.add_argument("--min-ops", type=int, default=50, help="steps with fewer GPU operations are left out")
    ap.add_argument("--ops", action="store_true", help="list the median step's operations in start order")
    ap.add_argument("--step", type=int, help="the step to detail instead of the median one")
    ap.add_argument("--own", action="store_true", help="each operation's time added to its stream, a step")
    ap.add_argument("--against", metavar="OTHER", help="compare with another build's trace of the same run")
    args = ap.parse_args()
    if args.against:
        return compare(args.trace, args.against, args.min_ops)
    if args.own:
        return own(args.trace, args.min_ops)
    gpu, api = read(args.trace)
    steps = [s for s in steps_of(gpu) if len(s) >= args.min_ops]
    if not steps:
        sys.exit("no step with enough GPU operations in the trace")
    print("step   ops   span us   busy us   idle: host-late us   other us")
    results = [analyse(s, api) for s in steps]
    for i, (s, (span, busy, late, other, _)) in enumerate(zip(steps, results)):
        print(f"{i:4d} {len(s):5d} {span / 1e3:9.1f} {busy / 1e3:9.1f} {late / 1e3:20.1f} {other / 1e3:10.1f}")

    # The longest run of consecutive steps with the same operation count: a decode run.
    run = decode_run(steps)
    best, chosen = (run.start, run.stop), list(run)
    spans = [results[i][0] for i in chosen]
    median = chosen[spans.index(statistics.median_low(spans))]
    if args.step is not None:
        if not 0 <= args.step < len(steps):
            sys.exit(f"no step {args.step}: the trace has {len(steps)}")
        best, chosen, median = (args.step, args.step + 1), [args.step], args.step
        spans = [results[args.step][0]]
    span, busy, late, other, gaps = results[median]
    print(f"\nsteps {best[0]}..{best[1] - 1} alike ({len(steps[median])} ops); median step {median}: "
          f"span {span / 1e3:.1f} us, busy {busy / 1e3:.1f} ({100 * busy / span:.1f}%), "
          f"idle host-late {late / 1e3:.1f}, other {other / 1e3:.1f}")
    print(f"  mean over the run: span {statistics.mean(spans) / 1e3:.1f} us, "
          f"host-late {statistics.mean(results[i][2] for i in chosen) / 1e3:.1f}, "
          f"other idle {statistics.mean(results[i][3] for i in chosen) / 1e3:.1f}")
    kinds = collections.Counter()
    for rec in steps[median]:
        kinds[rec[2]] += 1
    print("  operations:", ", ".join(f"{n} {k}" for k, n in kinds.items()))
    small = [g for g in gaps if g[0] < 5000]
    print(f"  gaps: {len(gaps)}, {sum(g[0] for g in gaps) / 1e3:.1f} us; under 5 us: {len(small)} "
          f"({sum(g[0] for g in small) / 1e3:.1f} us)")
    print(f"\nlargest gaps of step {median} (us, host-late?, after -> before):")
    for gap, before, after, host_late in sorted(gaps, key=lambda g: -g[0])[: args.gaps]:
        print(f"  {gap / 1e3:7.1f} {'late' if host_late else '    '}  {label(before)}  ->  {label(after)}")
    by_name = collections.defaultdict(lambda: [0, 0])
    for rec in steps[median]:
        by_name[label(rec)][0] += rec[1] - rec[0]
        by_name[label(rec)][1] += 1
    print(f"\ntime by operation in step {median} (us, count):")
    for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:30]:
        print(f"  {t / 1e3:8.1f} {n:4d}  {name}")
    if args.ops:
        t0 = steps[median][0][0]
        print(f"\noperations of step {median} (us from its start: start, end, length; stream):")
        for rec in steps[median]:
            print(f"  {(rec[0] - t0) / 1e3:8.1f} {(rec[1] - t0) / 1e3:8.1f} {(rec[1] - rec[0]) / 1e3:6.1f}  "
                  f"s{rec[5]:<4d} {label(rec)}")


if __name__ == "__main__":
    main()
