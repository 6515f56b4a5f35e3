#!/usr/bin/env python3
"""`keel bench` of two builds or more, alternating, in one run: the kind of A/B behind docs/perf.md's rows.

    python3 tools/ab_bench.py --rounds 2 before/keel after/keel [other/keel ...] -- \\
        --model flash4 --device cuda --prompt 512 --decode 32 --runs 2 \\
        --batch 1,8,64 --batch-prompt 32

Each round runs build A, then build B (then C, ...), with the same arguments and
`--json`. Then it prints every figure's runs for each build, and each later build's mean
against A's, in percent, with `+` where it is better (faster or more tokens/s) and `-`
where it is worse. The alternation is there because a GPU's speed drifts over minutes
(clocks, temperature): runs of one build after the other would carry that drift into the
comparison. The copy bandwidth each run measured is printed too, as the roofline of that
run. A "build" is any executable taking keel's arguments: a script that sets an
environment variable and runs keel compares settings of one binary.

With --same-logits N, each build first writes the logits of N token ids fed one at a
time (`keel logits --decode`, with the bench's --model and --device; ids below 512), and
each later build's must equal A's byte for byte: a change meant to keep the bits is
checked in the same run. A difference is printed (where the first one lies) and makes
the exit status 1 once the figures are printed.

With --trace LIB (tools/gpu_trace.cpp's libgpu_trace.so, built on the GPU machine), each
build then runs the bench once more under that CUPTI tracer, its trace written to
--trace-dir (default traces) as NAME.csv, and each later build's decode step is set
against A's by operation (tools/gpu_timeline.py --against): whether the kernel a change
aims at moved, where the end-to-end figures' spread is wider than the change.

A run that fails stops the script, with its error output. Needs Python 3 alone.
"""

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile

import gpu_timeline


def figures(report):
    """(name, value, higher_is_better) for each figure of one `keel bench --json` report."""
    yield "prefill tok/s", report["prefill_tok_s"], True
    yield "decode ms/token", 1e3 / report["decode_tok_s"], False
    if "decode_waited_tok_s" in report:  # builds with pipelined decode
        yield "decode, steps waited, ms/token", 1e3 / report["decode_waited_tok_s"], False
    yield "share of copy bandwidth %", 100.0 * report["bandwidth_share"], True
    for b in report["batched"]:
        yield f"batched decode {b['batch']} tok/s", b["tok_s"], True
        if "waited_step_ms" in b:
            yield f"batched decode {b['batch']}, steps waited, tok/s", 1e3 * b["batch"] / b["waited_step_ms"], True
    for p in report["prefill"]:
        yield f"prefill {p['tokens']} tokens tok/s", p["tok_s"], True
    for s in report["speculative"]:
        yield f"speculative {s['drafts']} tok/s", s["tok_s"], True
    yield "copy bandwidth GB/s (the run's roofline)", report["memory_read_gb_s"], None


def keel(binary, command, args, env=None):
    """`binary command args...` (in env, if given): its standard output; a failure stops the
    script, with its error output."""
    try:
        run = subprocess.run([binary, command, *args], capture_output=True, text=True, env=env)
    except OSError as e:
        sys.exit(f"cannot run {binary}: {e.strerror}")
    if run.returncode != 0:
        sys.exit(f"{binary} {command} failed (exit {run.returncode}):\n{run.stderr[-2000:]}")
    return run.stdout


def bench(binary, args, env=None):
    """One `keel bench` run: its report."""
    # The report is the last line (progress and the kernel plan go to stderr or before it).
    return json.loads(keel(binary, "bench", [*args, "--json"], env).strip().splitlines()[-1])


def traced(names, builds, args, library, folder):
    """Each build's bench once under the CUPTI tracer; each later build's operations against A's."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, binary in zip(names, builds):
        paths.append(os.path.join(folder, f"{name}.csv"))
        bench(binary, args, {**os.environ, "CUDA_INJECTION64_PATH": os.path.abspath(library),
                             "KEEL_GPU_TRACE": paths[-1]})
        if not os.path.exists(paths[-1]):
            sys.exit(f"{binary} left no trace at {paths[-1]}: is {library} the tracer?")
    for name, path in zip(names[1:], paths[1:]):
        print(f"\ntraced decode step, {name} against A ({paths[0]}, {path}):")
        gpu_timeline.compare(paths[0], path, min_ops=50)


def option(args, name):
    """The value of keel's option `name` in args (`--name value` or `--name=value`), or None."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1:]
    return None


def logits(binary, model, device, ids_file, out):
    """The build's logits of the ids, fed one at a time, as the bytes of its .npy file."""
    keel(binary, "logits", ["--model", model, "--ids", ids_file, "--out", out, "--decode"] +
         (["--device", device] if device else []))
    with open(out, "rb") as f:
        return f.read()


def first_difference(a, b):
    """Where two float32 .npy files of logits [tokens, vocab] first differ: a phrase for the report."""
    if len(a) != len(b):
        return f"{len(a)} against {len(b)} bytes"
    at = next(i for i in range(len(a)) if a[i] != b[i])
    # .npy: magic, version (2 bytes), header length (2 bytes, little-endian, version 1),
    # the header (a dict with the shape), then the values.
    start = 10 + int.from_bytes(a[8:10], "little")
    if at < start:
        return "in the .npy header"
    shape = ast.literal_eval(a[10:start].decode("latin1").strip())["shape"]
    value = (at - start) // 4
    return f"first at token {value // shape[1]}, logit {value % shape[1]}"


def same_logits(names, builds, args, count):
    """Each build's logits of `count` ids against A's; True where all are the same bits."""
    model = option(args, "--model")
    if model is None:
        sys.exit("--same-logits needs --model among keel bench's arguments")
    device = option(args, "--device")
    with tempfile.TemporaryDirectory() as folder:
        ids_file = os.path.join(folder, "ids.txt")
        with open(ids_file, "w") as f:
            f.write("\n".join(str((97 * i + 11) % 512) for i in range(count)) + "\n")
        outputs = [logits(b, model, device, ids_file, os.path.join(folder, f"{n}.npy")) for n, b in zip(names, builds)]
    same = True
    for name, out in zip(names[1:], outputs[1:]):
        if out == outputs[0]:
            print(f"logits of {count} ids, one at a time: {name} the same bits as A")
        else:
            print(f"logits of {count} ids, one at a time: {name} DIFFERS from A ({first_difference(outputs[0], out)})")
            same = False
    print()
    return same


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="every build once, this many times (default 2)")
    parser.add_argument("--same-logits", type=int, default=0, metavar="N",
                        help="first check that every build gives A's logits of N ids bit for bit (default 0: no check)")
    parser.add_argument("--trace", metavar="LIB", help="then each build once under this CUPTI tracer (libgpu_trace.so)")
    parser.add_argument("--trace-dir", default="traces", help="where the traces go (default traces)")
    parser.add_argument("builds", nargs="+", help="build A's keel binary (before), then B's (after), and any others")
    argv = sys.argv[1:]
    at = argv.index("--") if "--" in argv else len(argv)  # keel bench's arguments follow the first "--"
    o = parser.parse_args(argv[:at])
    args = argv[at + 1:]
    if o.rounds < 1 or len(o.builds) < 2 or not args:
        parser.error("needs --rounds of at least 1, two builds or more, and keel bench's arguments after --")

    names = [chr(ord("A") + i) for i in range(len(o.builds))]
    same = same_logits(names, o.builds, args, o.same_logits) if o.same_logits > 0 else True
    runs = {name: [] for name in names}
    for r in range(o.rounds):
        for name, binary in zip(names, o.builds):
            runs[name].append(list(figures(bench(binary, args))))
            # Each run's figures as it ends, so that a run cut short still leaves them.
            done = ", ".join(f"{figure} {value:.3f}" for figure, value, _ in runs[name][-1])
            print(f"round {r + 1}: {name} done: {done}", file=sys.stderr, flush=True)

    for name, binary in zip(names, o.builds):
        print(f"{name}: {binary}")
    print(f"keel bench {' '.join(args)}; {o.rounds} round(s), {' then '.join(names)} each\n")
    # Every build's figures by name, in the order they first come (builds may differ in
    # which figures their bench reports); a figure is set against A's where A has it.
    order = {}
    for name in names:
        for figure, _, higher in runs[name][0]:
            order.setdefault(figure, higher)
    values = lambda name, figure: [v for run in runs[name] for f, v, _ in run if f == figure]
    width = max(len(figure) for figure in order)
    for figure, higher in order.items():
        # A build's runs of the figure, and their spread where there are several.
        column = lambda vs: cells(vs) + (f" (spread {spread(vs):.1f}%)" if o.rounds > 1 else "")
        a = values("A", figure)
        line = f"{figure:<{width}}  A {column(a) if a else '-'}"
        for name in names[1:]:
            b = values(name, figure)
            if not b:
                line += f"  {name} -"
                continue
            line += f"  {name} {column(b)}"
            if a:
                change = (statistics.mean(b) / statistics.mean(a) - 1.0) * 100.0
                verdict = "" if higher is None else ("+" if (change > 0) == higher else "-") if change else "="
                line += f" {name}/A {change:+.1f}% {verdict}"
        print(line)
    if o.trace:
        traced(names, o.builds, args, o.trace, o.trace_dir)
    if not same:
        sys.exit(1)


def cells(values):
    """A build's runs of one figure."""
    return " / ".join(f"{v:.3f}" if v < 100 else f"{v:.1f}" for v in values)


def spread(values):
    """How far a build's runs of one figure lie apart, in percent of their mean: a change
    smaller than this is not told apart from the noise (one round shows none: use two or
    more)."""
    return (max(values) - min(values)) / statistics.mean(values) * 100.0


if __name__ == "__main__":
    main()
