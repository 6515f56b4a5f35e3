#!/usr/bin/env bash
# On a GPU machine: the A/B of builds carried from tools/pending_builds.sh (CARRY/NAME/keel.xz)
# by tools/ab_bench.py, on a Flash-shaped checkpoint that `keel synth` writes first.
#
#   tools/pending_ab.sh [--carry DIR] [--layers N] [--model DIR] [--rounds R] [--logits N]
#                       [--trace DIR] A B [NAME ...] -- BENCH_ARGS
#
# A is the build the others are set against (usually main). Where the checkpoint --model
# (default /dev/shm/flashN: memory, since the GPU machine's disk holds about 18 layers, 62
# GB, and little else) is not there yet, A's keel writes it first: `synth --shape flash
# --layers N --mtp-layers 0`, N from --layers (default 18). --rounds (default 2) and
# --logits (ab_bench's --same-logits, default 20) go to ab_bench. --trace DIR builds
# tools/gpu_trace.cpp against the CUDA toolkit's CUPTI and has ab_bench run each build
# once more under it, its trace in DIR. BENCH_ARGS are keel bench's after --model (e.g.
# --device cuda --prompt 512 --decode 32 --runs 2 --batch 1,8,64 --batch-prompt 32).
set -euo pipefail

usage() {
  echo "usage: tools/pending_ab.sh [--carry DIR] [--layers N] [--model DIR] [--rounds R] [--logits N] [--trace DIR] A B [NAME ...] -- BENCH_ARGS" >&2
  exit 2
}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/tools/carried.sh"
carry=$root/build-carry
layers=18
model=
rounds=2
logits=20
trace=
names=()
while (($#)); do
  case $1 in
    --carry) (($# >= 2)) || usage; carry=$(realpath -m "$2"); shift 2 ;;
    --layers) (($# >= 2)) && [[ $2 =~ ^[1-9][0-9]*$ ]] || usage; layers=$2; shift 2 ;;
    --model) (($# >= 2)) || usage; model=$(realpath -m "$2"); shift 2 ;;
    --rounds) (($# >= 2)) || usage; rounds=$2; shift 2 ;;
    --logits) (($# >= 2)) || usage; logits=$2; shift 2 ;;
    --trace) (($# >= 2)) || usage; trace=$(realpath -m "$2"); shift 2 ;;
    --) shift; break ;;
    -*) usage ;;
    *) names+=("$1"); shift ;;
  esac
done
((${#names[@]} >= 2)) || usage
bench_args=("$@")

bins=$(mktemp -d)
trap 'rm -rf "$bins"' EXIT
builds=()
for name in "${names[@]}"; do
  carried_unpack "$carry/$name/keel.xz" "$bins/$name/keel"
  builds+=("$bins/$name/keel")
done
carried_find_nccl "${builds[0]}"

model=${model:-/dev/shm/flash$layers}
[[ -d $model ]] || "${builds[0]}" synth --shape flash --layers "$layers" --mtp-layers 0 --out "$model"

ab_args=(--rounds "$rounds" --same-logits "$logits")
if [[ -n $trace ]]; then
  # CUPTI's header and library lie under the toolkit nvcc belongs to, in a place that
  # differs between toolkit layouts.
  cuda=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  cupti_include=$(dirname "$(find -L "$cuda" -name cupti.h | head -1)")
  cupti_lib=$(dirname "$(find -L "$cuda" -name 'libcupti.so*' | head -1)")
  export LD_LIBRARY_PATH=$cupti_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  g++ -std=c++20 -O2 -shared -fPIC -I"$cupti_include" -I"$cuda/include" "$root/tools/gpu_trace.cpp" \
    -L"$cupti_lib" -lcupti -o "$bins/libgpu_trace.so"
  ab_args+=(--trace "$bins/libgpu_trace.so" --trace-dir "$trace")
fi

echo "model: $model"
python3 "$root/tools/ab_bench.py" "${ab_args[@]}" "${builds[@]}" -- --model "$model" "${bench_args[@]}"
