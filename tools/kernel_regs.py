#!/usr/bin/env python3
"""Registers and spills of a .cu file's kernels, against another commit's: before device time.

A one-token product's blocks per multiprocessor are often set by its registers, and a
few more of them can cost more than a change saves (docs/perf.md, 2026-12-04: a split-x
kernel at 76 registers instead of 62, 3 blocks a multiprocessor instead of 4, 8.0 -> 9.4
us). This compiles the file as the build does (its command in compile_commands.json,
with ptxas's --resource-usage) in the working tree and, with --against, in a temporary
git worktree at that commit, and prints each kernel whose figures differ:

    python3 tools/kernel_regs.py --build build-gpu src/keel/cuda/gemm_mma.cu --against HEAD
    python3 tools/kernel_regs.py --build build-gpu src/keel/cuda/mhc.cu            (one column)
    python3 tools/kernel_regs.py --build build-gpu src/keel/cuda/gemm_mma.cu --against HEAD --ptx

Blocks a multiprocessor by registers alone are given for --threads threads a block
(256, the tiles') and 64 K registers a multiprocessor, allocated 8 a warp at a time.

--ptx adds each kernel's PTX (kept from the same compile): its instructions, and of them
the MMAs, the f32 -> bf16x2 conversions and the barriers. These are static counts: a
loop's body counts once however often it runs, so they compare code, not a launch's work.
For example, with the staged tile's x split once per block instead of once per warp
(8a76777), the FP4 kernel's conversions go 256 -> 8 (its step is unrolled: the
256 ran once a unit, the 8 are the split's), and the bf16 kernel's go 16 -> 24 though
its step loop, four times a unit, lost all 16 (the 24 are the split's loop unrolled:
8 of them run a unit). The machine code itself would need cuobjdump, which a toolkit
without the binary utilities lacks. Needs Python 3, git and the build's nvcc; no GPU.
"""

import argparse
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

REGISTERS = 65536


def compile_command(build, source):
    """The build's nvcc command for source (an absolute path), as a list, and its directory."""
    with open(os.path.join(build, "compile_commands.json")) as f:
        for entry in json.load(f):
            if os.path.realpath(entry["file"]) == source:
                return shlex.split(entry["command"]), entry["directory"]
    sys.exit(f"kernel_regs: {source} is not in {build}/compile_commands.json")


# What --ptx counts in a kernel's PTX besides its instructions: (label, opcode prefix).
PTX_OPS = (("mma", "mma.sync"), ("cvt.bf16x2", "cvt.rn.bf16x2.f32"), ("bar", "bar"))


def ptx_counts(directory):
    """{(arch, mangled name): (instructions, *PTX_OPS counts)} over the .ptx files nvcc kept in directory."""
    counts = {}
    for path in glob.glob(os.path.join(directory, "*.ptx")):
        with open(path) as f:
            text = f.read()
        arch = re.search(r"^\.target\s+(\w+)", text, re.M).group(1)
        for m in re.finditer(r"^(?:\.visible\s+)?\.entry\s+(\w+)\((.*?)^\}", text, re.S | re.M):
            ops = [line.split()[0] if not line.startswith("@") else line.split()[1]
                   for line in (raw.strip() for raw in m.group(2).splitlines())
                   if line and line[0] not in ".$/{})" and not line.endswith(":")]
            counts[(arch, m.group(1))] = (len(ops), *(sum(op.startswith(prefix) for op in ops) for _, prefix in PTX_OPS))
    return counts


def resource_usage(command, directory, root, tree, ptx=False):
    """{kernel (short): (registers, spill stores, spill loads[, PTX counts])} for the
    command run on tree's copy of the sources (paths under root moved to tree). Kernels
    are named by their demangled names: an anonymous namespace's mangled name depends on
    the path."""
    args = []
    skip = False
    for arg in command:
        if skip:
            skip = False
            continue
        if arg == "-o":  # the object goes nowhere
            skip = True
            continue
        args.append(arg.replace(root, tree))
    with tempfile.TemporaryDirectory() as out:
        args += ["-o", os.path.join(out, "kernel.o"), "-Xptxas", "-v"]
        if ptx:
            args += ["--keep", "--keep-dir", out]
        run = subprocess.run(args, cwd=directory, capture_output=True, text=True)
        counts = ptx_counts(out) if ptx and run.returncode == 0 else {}
    if run.returncode != 0:
        sys.exit(f"kernel_regs: compiling in {tree} failed:\n{run.stderr[-3000:]}")
    usage, name, spills = {}, None, (0, 0)
    for line in run.stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)' for '(\w+)'", line):
            name, spills = (m.group(2), m.group(1)), (0, 0)
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            spills = (int(m.group(1)), int(m.group(2)))
        elif (m := re.search(r"Used (\d+) registers", line)) and name:
            usage[short(name)] = (int(m.group(1)), *spills, *counts.get(name, ()))
            name = None
    return usage


def blocks_by_registers(registers, threads):
    per_warp = (registers * 32 + 255) // 256 * 256  # allocated in units of 256 a warp
    warps = (threads + 31) // 32
    return REGISTERS // (per_warp * warps)


def short(key):
    """The kernel's name and template arguments, without namespaces or parameters, and its arch."""
    arch, mangled = key
    name = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip() or mangled
    name = re.sub(r"\(anonymous namespace\)::|keel::cuda::|keel::|^void ", "", name)
    return f"{name.replace('(WeightFormat)', 'F').split('(', 1)[0]} [{arch}]"


def describe(figures, threads):
    registers, stores, loads, *ptx = figures
    spill = f", spills {stores}/{loads} B" if stores or loads else ""
    text = f"{registers:>3} ({blocks_by_registers(registers, threads)} blocks{spill})"
    if ptx:
        text += f" PTX {ptx[0]:>5}: " + " ".join(f"{label} {n}" for (label, _), n in zip(PTX_OPS, ptx[1:]))
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="a .cu file of the build")
    ap.add_argument("--build", default="build-gpu", help="a build directory with compile_commands.json")
    ap.add_argument("--against", help="a commit to compare with (compiled in a temporary worktree)")
    ap.add_argument("--threads", type=int, default=256, help="threads a block, for the blocks column")
    ap.add_argument("--ptx", action="store_true", help="also each kernel's PTX instructions, MMAs, conversions, barriers")
    args = ap.parse_args()

    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    source = os.path.realpath(args.source)
    command, directory = compile_command(args.build, source)
    now = resource_usage(command, directory, root, root, args.ptx)
    if not args.against:
        for name in sorted(now):
            print(f"{describe(now[name], args.threads)}  {name}")
        return
    with tempfile.TemporaryDirectory() as tree:
        subprocess.run(["git", "worktree", "add", "--detach", tree, args.against], cwd=root, check=True,
                       capture_output=True)
        try:
            before = resource_usage(command, directory, root, tree, args.ptx)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=root, capture_output=True)
    changed = [n for n in sorted(set(now) | set(before)) if now.get(n) != before.get(n)]
    print(f"{len(changed)} of {len(set(now) | set(before))} kernels differ ({args.against} -> working tree)")
    rows = [(describe(before[name], args.threads) if name in before else "  -",
             describe(now[name], args.threads) if name in now else "  -", name) for name in changed]
    width = max((len(old) for old, _, _ in rows), default=0)
    for old, new, name in rows:
        print(f"{old:>{width}} -> {new:<{width}}  {name}")


if __name__ == "__main__":
    main()
