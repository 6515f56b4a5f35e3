#!/usr/bin/env bash
# On the GPU machine: where a decode step's time goes, kernel by kernel, and where the warps
# of the kernels a regex names wait, for a build carried from tools/pending_builds.sh
# (CARRY/NAME/keel.xz). Two ncu passes over the same `keel bench --eager` run on a small
# Flash-shaped checkpoint, which the build's keel writes to /dev/shm first: the step table
# (tools/step_kernels.py: each kernel alone, caches flushed, with what it read), then the
# full set with warp-state samples for the last whole step's launches that REGEX finds
# (tools/stall_samples.py). Few layers keep ncu's kernel replay short: it saves and
# restores the device memory a kernel may write, and for the 18-layer checkpoint (63 GB)
# that did not end within a device call (docs/perf.md, 2026-12-07).
#
#   tools/profile_step.sh [--carry DIR] [--layers N] [--model DIR] [--kernels REGEX] [--out DIR] NAME
#
# --layers defaults to 2, --model to /dev/shm/flashN (written where it is not there yet),
# --kernels to the one-token products, decode attention and the mHC site inputs, --out to
# $OUT/profile-NAME where $OUT is set (a device call's results), else
# build-pending/profile-NAME. It writes step.csv and step.txt (the table), source.csv (ncu's
# SASS page of the profiled launches) and stalls.txt, one block a launch.
set -euo pipefail

usage() {
  echo "usage: tools/profile_step.sh [--carry DIR] [--layers N] [--model DIR] [--kernels REGEX] [--out DIR] NAME" >&2
  exit 2
}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/tools/carried.sh"
carry=$root/build-carry
layers=2
model=
kernels='mma_pairs|mma_linear|mma_group|decode|site_in'
out=
while (($#)); do
  case $1 in
    --carry) (($# >= 2)) || usage; carry=$(realpath -m "$2"); shift 2 ;;
    --layers) (($# >= 2)) && [[ $2 =~ ^[1-9][0-9]*$ ]] || usage; layers=$2; shift 2 ;;
    --model) (($# >= 2)) || usage; model=$(realpath -m "$2"); shift 2 ;;
    --kernels) (($# >= 2)) || usage; kernels=$2; shift 2 ;;
    --out) (($# >= 2)) || usage; out=$(realpath -m "$2"); shift 2 ;;
    -*) usage ;;
    *) break ;;
  esac
done
(($# == 1)) || usage
name=$1
out=${out:-${OUT:+$OUT/profile-$name}}
out=${out:-$root/build-pending/profile-$name}
mkdir -p "$out"

bins=$(mktemp -d)
trap 'rm -rf "$bins"' EXIT
keel=$bins/keel
carried_unpack "$carry/$name/keel.xz" "$keel"
carried_find_nccl "$keel"
model=${model:-/dev/shm/flash$layers}
[[ -d $model ]] || "$keel" synth --shape flash --layers "$layers" --mtp-layers 0 --out "$model"

# The same run for both passes, so that the launches come in the same order.
run=("$keel" bench --model "$model" --device cuda --prompt 64 --decode 6 --runs 1 --eager)
ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --page raw \
  --log-file "$out/step.csv" "${run[@]}" > "$out/step-run.log"
python3 "$root/tools/step_kernels.py" "$out/step.csv" > "$out/step.txt"
launches=$(python3 "$root/tools/step_kernels.py" "$out/step.csv" --launches "$kernels")  # exits where none match
mapfile -t select <<< "$launches"
ncu --clock-control none --set full --import-source no "${select[@]}" -f -o "$out/prof" "${run[@]}" \
  > "$out/prof-run.log"
ncu -i "$out/prof.ncu-rep" --page source --csv --print-source sass > "$out/source.csv"
python3 "$root/tools/stall_samples.py" "$out/source.csv" > "$out/stalls.txt"
echo "profile of $name: $out (step.txt, stalls.txt)"
