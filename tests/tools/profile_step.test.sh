#!/usr/bin/env bash
# tools/profile_step.sh against a stand-in carried keel and a stand-in ncu (no GPU): the
# checkpoint written only where it is missing, the second pass given the last whole step's
# launches of the kernels asked for (and not run where none match), and the step table and
# the stall summary written.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
export STAND_IN_LOG=$work/log

# The stand-in keel: `synth` makes its --out folder; every command logs its arguments.
cat >"$work/keel" <<'PY'
#!/usr/bin/env python3
import os, sys
with open(os.environ["STAND_IN_LOG"], "a") as log:
    log.write("keel " + " ".join(sys.argv[1:]) + "\n")
if sys.argv[1] == "synth":
    os.makedirs(sys.argv[sys.argv.index("--out") + 1])
PY
mkdir -p "$work/carry/main" "$work/bin"
xz -c "$work/keel" >"$work/carry/main/keel.xz"

# The stand-in ncu: the step pass writes three steps of five kernels, each step ending with
# the sampler's; the full pass logs its selection and writes the report; the source page
# is one launch of three instructions.
cat >"$work/bin/ncu" <<'PY'
#!/usr/bin/env python3
import csv, os, sys
args = sys.argv[1:]
with open(os.environ["STAND_IN_LOG"], "a") as log:
    log.write("ncu " + " ".join(args) + "\n")
if "--log-file" in args:
    rows = [["==PROF== Connected"], ["ID", "Kernel Name", "Grid Size", "Block Size", "gpu__time_duration.sum",
                                     "dram__bytes_read.sum"], ["", "", "", "", "usecond", "Mbyte"]]
    names = ["site_in", "mma_group", "decode", "mma_pairs", "summarize_kernel"] * 3
    for i, name in enumerate(names):
        rows.append([str(i), f"void keel::cuda::(anonymous namespace)::{name}<2>(int)", "(8, 1, 1)", "(256, 1, 1)",
                     "10", "4"])
    with open(args[args.index("--log-file") + 1], "w", newline="") as f:
        csv.writer(f).writerows(rows)
elif "-o" in args:
    open(args[args.index("-o") + 1] + ".ncu-rep", "w").close()
elif "-i" in args:
    w = csv.writer(sys.stdout)
    w.writerow(["Kernel Name", "void keel::cuda::(anonymous namespace)::mma_pairs<2>(int)"])
    w.writerow(["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait"])
    for address, sass, samples, runs in [("0", "LDC R1, c[0x0][0x28]", 5, 8), ("10", "HMMA.16816.F32.BF16 R4, R8", 30, 96),
                                         ("20", "EXIT", 1, 8)]:
        w.writerow([address, sass, samples, runs, samples // 2])
PY
chmod +x "$work/bin/ncu"
export PATH=$work/bin:$PATH

run() { "$root/tools/profile_step.sh" --carry "$work/carry" --model "$work/flash2" --out "$work/out" "$@" >"$work/said" 2>&1; }
run --kernels 'mma_pairs|decode' main || { cat "$work/said"; fail "the profile failed"; }
grep -q "^keel synth --shape flash --layers 2 --mtp-layers 0 --out $work/flash2$" "$work/log" || fail "the synth"
grep -q "^ncu .* --kernel-name regex:mma_pairs|decode --launch-skip 4 --launch-count 2 -f -o $work/out/prof .*keel bench --model $work/flash2 .*--eager$" "$work/log" ||
  { cat "$work/log"; fail "the full pass's launches"; }
grep -q '^last whole step: 5 kernels, 50.0 us' "$work/out/step.txt" || fail "the step table"
grep -q 'mma_pairs<2>' "$work/out/stalls.txt" && grep -q 'stalls: wait' "$work/out/stalls.txt" || fail "the stall summary"

: >"$work/log"
run main || fail "the second profile failed"
grep -q "keel synth" "$work/log" && fail "a checkpoint that is there written again"
grep -q "regex:mma_pairs|mma_linear|mma_group|decode|site_in --launch-skip 8 --launch-count 4 " "$work/log" ||
  fail "the default kernels"

: >"$work/log"
run --kernels nothing_here main && fail "a regex that no launch matches"
grep -q -- "--set full" "$work/log" && fail "the full pass run without a selection"
grep -q "no launch of the last whole step matches 'nothing_here'" "$work/said" || fail "the empty selection named"

run Q && fail "a build that was not carried"
grep -q "no $work/carry/Q/keel.xz" "$work/said" || fail "the missing build named"
echo "profile_step: as expected"
