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

Blocks a multiprocessor by registers alone are given for --threads threads a block
(256, the tiles') and 64 K registers a multiprocessor, allocated 8 a warp at a time.
Needs Python 3, git and the build's nvcc; no GPU.
"""

import argparse
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


def resource_usage(command, directory, root, tree):
    """{kernel (short): (registers, spill stores, spill loads)} for the command run on
    tree's copy of the sources (paths under root moved to tree). Kernels are named by
    their demangled names: an anonymous namespace's mangled name depends on the path."""
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
        run = subprocess.run(args, cwd=directory, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"kernel_regs: compiling in {tree} failed:\n{run.stderr[-3000:]}")
    usage, name, spills = {}, None, (0, 0)
    for line in run.stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)' for '(\w+)'", line):
            name, spills = (m.group(2), m.group(1)), (0, 0)
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            spills = (int(m.group(1)), int(m.group(2)))
        elif (m := re.search(r"Used (\d+) registers", line)) and name:
            usage[short(name)] = (int(m.group(1)), *spills)
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
    registers, stores, loads = figures
    spill = f", spills {stores}/{loads} B" if stores or loads else ""
    return f"{registers:>3} ({blocks_by_registers(registers, threads)} blocks{spill})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="a .cu file of the build")
    ap.add_argument("--build", default="build-gpu", help="a build directory with compile_commands.json")
    ap.add_argument("--against", help="a commit to compare with (compiled in a temporary worktree)")
    ap.add_argument("--threads", type=int, default=256, help="threads a block, for the blocks column")
    args = ap.parse_args()

    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    source = os.path.realpath(args.source)
    command, directory = compile_command(args.build, source)
    now = resource_usage(command, directory, root, root)
    if not args.against:
        for name in sorted(now):
            print(f"{describe(now[name], args.threads)}  {name}")
        return
    with tempfile.TemporaryDirectory() as tree:
        subprocess.run(["git", "worktree", "add", "--detach", tree, args.against], cwd=root, check=True,
                       capture_output=True)
        try:
            before = resource_usage(command, directory, root, tree)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=root, capture_output=True)
    changed = [n for n in sorted(set(now) | set(before)) if now.get(n) != before.get(n)]
    print(f"{len(changed)} of {len(set(now) | set(before))} kernels differ ({args.against} -> working tree)")
    for name in changed:
        old = describe(before[name], args.threads) if name in before else "  -"
        new = describe(now[name], args.threads) if name in now else "  -"
        print(f"{old:>28} -> {new:<28}  {name}")


if __name__ == "__main__":
    main()
