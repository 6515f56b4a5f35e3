#!/usr/bin/env bash
# scripts/gpu-check's hung-test watchdog, its sanitizer shards that a filter leaves
# without tests, and tools/pending_check.sh's culprit table, against stand-ins for
# nvidia-smi, compute-sanitizer and keel_gpu_tests (no GPU needed). The stand-in tests:
# A.One passes, P/B.Two/0 fails in the builds ALL and Y, C.Hang hangs in ALL and X, D.Four
# passes, F.New exists only in ALL and fails there. Like gtest, the stand-in runs test i
# of its list in shard i mod GTEST_TOTAL_SHARDS; like compute-sanitizer, the stand-in
# exits 255 without a summary where the program made no CUDA call (ran no test).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

mkdir -p "$work/bin"
cat >"$work/bin/nvidia-smi" <<'SH'
#!/bin/sh
case "$*" in *-L*) echo "GPU 0: Stand-in (UUID: none)" ;; *query*) echo 0.0 ;; *) echo "CUDA Version: 13.0" ;; esac
SH
cat >"$work/bin/compute-sanitizer" <<'SH'
#!/usr/bin/env bash
args=()
while (($#)); do case $1 in --tool | --leak-check | --error-exitcode) shift 2 ;; *) args+=("$1"); shift ;; esac; done
echo "ran: ${args[*]}"
output=$("${args[@]}")
rc=$?
echo "$output"
if [[ $output == *"Running 0 tests"* ]]; then
  echo "========= Error: Target application terminated before first instrumented API call"
  exit 255
fi
echo "========= ERROR SUMMARY: 0 errors"
exit $rc
SH
cat >"$work/keel_gpu_tests" <<'SH'
#!/usr/bin/env bash
build=$(basename "$(dirname "$0")")
only="" without=""
for a in "$@"; do
  case $a in --gtest_filter=*-*) only=${a#--gtest_filter=}; without=${only#*-}; only=${only%%-*} ;;
    --gtest_filter=*) only=${a#--gtest_filter=} ;; esac
done
tests="A.One P/B.Two/0 C.Hang D.Four"
[[ $build == ALL ]] && tests+=" F.New"
selected=()
for t in $tests; do
  [[ ":$without:" == *":$t:"* ]] && continue
  [[ -n $only && $only != *'*'* && ":$only:" != *":$t:"* ]] && continue
  selected+=("$t")
done
shard=()
for i in "${!selected[@]}"; do
  ((i % ${GTEST_TOTAL_SHARDS:-1} == ${GTEST_SHARD_INDEX:-0})) && shard+=("${selected[i]}")
done
echo "[==========] Running ${#shard[@]} tests from 1 test suite."
ran=0 passed=0 failed=0
for t in "${shard[@]}"; do
  ran=$((ran + 1))
  echo "[ RUN      ] $t"
  if [[ $t == C.Hang && $build =~ ^(ALL|X)$ ]]; then exec sleep 1000; fi
  if [[ $t == P/B.Two/0 && $build =~ ^(ALL|Y)$ || $t == F.New ]]; then
    echo "[  FAILED  ] $t, where GetParam() = 1 (3 ms)"
    failed=$((failed + 1))
  else
    echo "[       OK ] $t (0 ms)"
    passed=$((passed + 1))
  fi
done
echo "[==========] $ran tests from 1 test suite ran. (0 ms total)"
echo "[  PASSED  ] $passed tests."
((failed == 0)) || { echo "[  FAILED  ] $failed test, listed below:"; exit 1; }
SH
chmod +x "$work/bin/"* "$work/keel_gpu_tests"
for build in ALL main X Y; do
  mkdir -p "$work/carry/$build"
  xz -c "$work/keel_gpu_tests" >"$work/carry/$build/keel_gpu_tests.xz"
done
export PATH=$work/bin:$PATH

# gpu-check names the hung test, and the other tests still run, the sanitizers without it.
OUT= timeout -k 5 120 "$root/tools/pending_check.sh" --carry "$work/carry" --out "$work/out" --hang 2 --only 'A.*:C.*' \
  ALL main X Y >"$work/log" 2>&1
rc=$?
cat "$work/log"
((rc != 0)) || fail "pending_check passed over a hung and a failing test"
summary=$work/out/ALL/summary.txt
grep -q '^tests .*hung (no end after 2 s, killed): C.Hang; without them: 2 passed, 0 skipped, 2 failed' "$summary" ||
  fail "gpu-check's tests line: $(grep '^tests' "$summary")"
grep -q '^\[ RUN      \] F.New' "$work/out/ALL/tests.log" || fail "the tests after the hung one did not run"
grep -q -- '--gtest_filter=A.\*:C.\*-.*:C.Hang ' "$work/out/ALL/memcheck.0.log" ||
  fail "memcheck's filter does not leave out C.Hang: $(grep '^ran:' "$work/out/ALL/memcheck.0.log")"
# Each suspect alone on each build: the culprit table.
diff <(cat "$work/out/culprits.txt") - <<'TXT' || fail "culprits.txt differs"
C.Hang: ALL HUNG, main ok, X HUNG, Y ok
F.New: ALL FAIL, main absent, X absent, Y absent
P/B.Two/0: ALL FAIL, main ok, X ok, Y FAIL
TXT
# Four sanitizer shards for one test: the three without a test pass.
mkdir -p "$work/one" && cp "$work/keel_gpu_tests" "$work/one/"
timeout -k 5 60 "$root/scripts/gpu-check" --build-dir "$work/one" --out "$work/one-out" --only 'D.Four' --jobs 4 \
  >"$work/one-log" 2>&1
rc=$?
cat "$work/one-log"
for tool in memcheck racecheck; do
  grep -q "^$tool *PASS .*1 passed" "$work/one-out/summary.txt" ||
    fail "$tool over one test in four shards: $(grep "^$tool" "$work/one-out/summary.txt")"
done
echo "gpu-check and pending_check: as expected"
