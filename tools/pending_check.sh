#!/usr/bin/env bash
# On a GPU machine: the tests of docs/pending's builds (tools/pending_builds.sh --tests),
# to find which patch breaks what before any A/B.
#
#   tools/pending_check.sh [--carry DIR] [--out DIR] [--hang S] [--only FILTER] ALL [NAME ...]
#
# ALL is the build with every patch: scripts/gpu-check runs all its tests (a test running
# --hang seconds, default 60, is stopped and named), then memcheck and racecheck on the
# patches' own suites (--only, a gtest filter; "none" skips them). Each test that failed
# or hung there then runs alone, under `timeout`, on each NAME (main and the single
# patches, e.g. main S U U+D B R M M+N), so that the patch that breaks it is named: one
# line a test in OUT/culprits.txt ("ok", "FAIL", "HUNG", or "absent" where that build
# lacks the test). --carry (default build-carry) holds NAME/keel_gpu_tests.xz; --out
# defaults to $OUT where set (a device call's results), else build-pending/check.
set -uo pipefail

usage() {
  echo "usage: tools/pending_check.sh [--carry DIR] [--out DIR] [--hang S] [--only FILTER] ALL [NAME ...]" >&2
  exit 2
}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/tools/carried.sh"
carry=$root/build-carry
out=${OUT:-$root/build-pending/check}
hang=60
only='CudaMhc.*:CudaMoe*:All/CudaMma.*:CudaMmaCases.*'
names=()
while (($#)); do
  case $1 in
    --carry) (($# >= 2)) || usage; carry=$(realpath -m "$2"); shift 2 ;;
    --out) (($# >= 2)) || usage; out=$(realpath -m "$2"); shift 2 ;;
    --hang) (($# >= 2)) && [[ $2 =~ ^[1-9][0-9]*$ ]] || usage; hang=$2; shift 2 ;;
    --only) (($# >= 2)) || usage; only=$2; shift 2 ;;
    -*) usage ;;
    *) names+=("$1"); shift ;;
  esac
done
((${#names[@]} >= 1)) || usage
all=${names[0]}
mkdir -p "$out" || exit 2

# Each build's tests, unpacked (gpu-check takes a build directory) apart from the results.
bins=$(mktemp -d)
trap 'rm -rf "$bins"' EXIT
for name in "${names[@]}"; do
  carried_unpack "$carry/$name/keel_gpu_tests.xz" "$bins/$name/keel_gpu_tests" || exit 2
done
carried_find_nccl "$bins/$all/keel_gpu_tests"

check_args=(--build-dir "$bins/$all" --out "$out/$all" --hang "$hang")
if [[ $only == none ]]; then check_args+=(--no-sanitizers); else check_args+=(--only "$only"); fi
"$root/scripts/gpu-check" "${check_args[@]}"
check_rc=$?

# The tests that hung or failed in ALL's run (a failing test's own line ends with its time).
suspects=$({
  cat "$out/$all/hung.txt" 2>/dev/null
  grep -hE '^\[  FAILED  \] .* \([0-9]+ ms\)$' "$out/$all/tests.log" 2>/dev/null | awk '{ name = $4; sub(/,$/, "", name); print name }'
} | sort -u)

export KEEL_SOURCE_DIR=$root
: >"$out/culprits.txt"
for test in $suspects; do
  line="$test:"
  for name in "${names[@]}"; do
    log=$out/alone.$name.$(echo "$test" | tr '/' '_').log
    timeout -k 5 "$hang" "$bins/$name/keel_gpu_tests" --gtest_filter="$test" >"$log" 2>&1
    rc=$?
    if ((rc == 124 || rc == 137)); then
      verdict=HUNG
    elif grep -q '^\[==========\] 0 tests' "$log"; then
      verdict=absent
    elif ((rc == 0)); then
      verdict=ok
    else
      verdict=FAIL
    fi
    line+=" $name $verdict,"
  done
  echo "${line%,}" | tee -a "$out/culprits.txt"
done
[[ -n $suspects ]] || echo "no test failed or hung in $all" | tee "$out/culprits.txt"
exit "$check_rc"
