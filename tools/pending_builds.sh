#!/usr/bin/env bash
# Builds keel for HEAD and for HEAD with docs/pending's patches applied, each stripped and
# xz-compressed into OUT/NAME/, to be carried to a GPU machine for the A/B and the tests
# that decide them (docs/pending/README.md). No GPU is needed here.
#
#   tools/pending_builds.sh [--out DIR] [--archs ARCHS] [--tests] [NAME ...]
#
# NAME is "main" (HEAD as it is) or patch letters joined by "+": "S" is HEAD with
# docs/pending/S-*.patch, "S+B+R" with those three applied in turn. Without names: main
# and each patch alone, or after those its message names in a "Depends-on: L" line
# ("M+N"; "Depends-on: K+I" makes "K+I+Z"). --tests adds keel_gpu_tests and
# keel_gpu_bench to each build (about 3 and 2 MB more each, compressed, where keel is
# about 3). --out defaults to build-carry, --archs to 90a (KEEL_CUDA_ARCHS).
#
# The builds share one worktree (build-pending/tree, at HEAD) and one build directory
# (build-pending/build): after the first (keel alone: about 3 minutes on two cores), a
# build recompiles only what its patches touch (about 40 s for gemm_mma.cu). The working
# tree of the checkout is not touched.
set -euo pipefail

usage() {
  echo "usage: tools/pending_builds.sh [--out DIR] [--archs ARCHS] [--tests] [NAME ...]" >&2
  exit 2
}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$root/build-carry
archs=90a
targets=(keel)
names=()
while (($#)); do
  case $1 in
    --out) (($# >= 2)) || usage; out=$(realpath -m "$2"); shift 2 ;;
    --archs) (($# >= 2)) || usage; archs=$2; shift 2 ;;
    --tests) targets+=(keel_gpu_tests keel_gpu_bench); shift ;;
    -*) usage ;;
    *) names+=("$1"); shift ;;
  esac
done
if ((${#names[@]} == 0)); then
  names=(main)
  for patch in "$root"/docs/pending/?-*.patch; do
    [[ -e $patch ]] || continue  # none pending: main alone
    name=$(basename "$patch")
    depends=$(sed -n 's/^Depends-on: \([A-Z][A-Z+]*\)$/\1+/p' "$patch")
    names+=("$depends${name%%-*}")
  done
fi

# The patch file of letter L (exactly one).
patch_of() {
  local found=("$root"/docs/pending/"$1"-*.patch)
  [[ ${#found[@]} == 1 && -f ${found[0]} ]] || { echo "pending_builds: no single docs/pending/$1-*.patch" >&2; exit 1; }
  echo "${found[0]}"
}
for name in "${names[@]}"; do  # every name checked before the first build
  [[ $name == main ]] && continue
  IFS=+ read -ra letters <<< "$name"
  for letter in "${letters[@]}"; do patch_of "$letter" > /dev/null; done
done

work=$root/build-pending
tree=$work/tree
head=$(git -C "$root" rev-parse HEAD)
if [[ ! -e $tree/.git ]]; then
  mkdir -p "$work"
  git -C "$root" worktree add -q --detach "$tree" "$head"
fi
# Configured every run (seconds once it exists), so that --archs always takes effect.
cmake -S "$tree" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release "-DKEEL_CUDA_ARCHS=$archs" \
  > "$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }

for name in "${names[@]}"; do
  git -C "$tree" checkout -q --force --detach "$head"
  git -C "$tree" clean -q -fd
  if [[ $name != main ]]; then
    IFS=+ read -ra letters <<< "$name"
    for letter in "${letters[@]}"; do git -C "$tree" apply "$(patch_of "$letter")"; done
  fi
  echo "== $name: building ${targets[*]}"
  cmake --build "$work/build" -j "$(nproc)" --target "${targets[@]}" > "$work/build-$name.log" 2>&1 ||
    { tail -30 "$work/build-$name.log"; exit 1; }
  mkdir -p "$out/$name"
  for target in "${targets[@]}"; do
    strip -o "$out/$name/$target" "$work/build/$target"
    xz -9 -T0 -f "$out/$name/$target"
  done
done
git -C "$tree" checkout -q --force --detach "$head"
du -b "$out"/*/*.xz | awk '{ total += $1; print } END { printf "%d bytes in all\n", total }'
