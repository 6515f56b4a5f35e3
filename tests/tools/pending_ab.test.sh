#!/usr/bin/env bash
# tools/pending_ab.sh against stand-in carried builds (no GPU): each build's keel unpacked
# and run by ab_bench with the bench's arguments after --model, the checkpoint written by
# A's keel only where it is missing, and a build that was not carried named.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# The stand-in keel: `synth` makes its --out folder and logs its arguments; `bench`
# decodes at 2 ms a token in build main and 1.5 in build P, and logs its arguments;
# `logits` writes the same bytes in every build.
cat >"$work/keel" <<'PY'
#!/usr/bin/env python3
import json, os, sys
build = os.path.basename(os.path.dirname(os.path.abspath(__file__)))
command, args = sys.argv[1], sys.argv[2:]
with open(os.environ["STAND_IN_LOG"], "a") as log:
    log.write(f"{build} {command} {' '.join(args)}\n")
if command == "synth":
    os.makedirs(args[args.index("--out") + 1])
elif command == "logits":
    with open(args[args.index("--out") + 1], "wb") as f:
        f.write(b"same bits")
elif command == "bench":
    ms = {"main": 2.0, "P": 1.5}[build]
    print(json.dumps({"prefill_tok_s": 1000.0, "decode_tok_s": 1e3 / ms, "bandwidth_share": 0.4,
                      "batched": [], "prefill": [], "speculative": [], "memory_read_gb_s": 4000.0}))
PY
for build in main P; do
  mkdir -p "$work/carry/$build"
  xz -c "$work/keel" >"$work/carry/$build/keel.xz"
done
export STAND_IN_LOG=$work/log

run() { "$root/tools/pending_ab.sh" --carry "$work/carry" --rounds 1 --logits 3 "$@" >"$work/out" 2>&1; }
run --layers 2 --model "$work/flash2" main P -- --device cuda --prompt 512 || { cat "$work/out"; fail "the A/B failed"; }
cat "$work/out"
grep -q "^main synth --shape flash --layers 2 --mtp-layers 0 --out $work/flash2$" "$work/log" || fail "the synth"
grep -q "^P bench --model $work/flash2 --device cuda --prompt 512 --json$" "$work/log" || fail "the bench's arguments"
grep -q '^logits of 3 ids, one at a time: B the same bits as A$' "$work/out" || fail "the logits line"
grep -q '^decode ms/token .* B/A -25.0% +$' "$work/out" || fail "the decode line"

: >"$work/log"
run --layers 2 --model "$work/flash2" main P -- --device cuda || fail "the second A/B failed"
grep -q " synth " "$work/log" && fail "a checkpoint that is there written again"

run --model "$work/flash2" main Q -- --device cuda && fail "a build that was not carried"
grep -q "no $work/carry/Q/keel.xz" "$work/out" || fail "the missing build named"
echo "pending_ab: as expected"
