#!/usr/bin/env bash
# tools/serve_load.py on the CPU with the demo model and the built keel: two servers per
# load (steps read one by one, then pipelined), both figures printed, and the greedy
# completions the same text over HTTP in both.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
keel=$1
fail() { echo "FAIL: $*"; exit 1; }
out=$(cd "$root" && timeout 300 python3 tools/serve_load.py --keel "$keel" --model models/keel-tiny-v4 --device cpu \
  --clients 3 --requests 2 --max-tokens 10 --rounds 1 2>&1) || fail "serve_load exited non-zero: $out"
echo "$out"
grep -q '^3 clients, waited: [0-9.]* tok/s' <<<"$out" || fail "no waited figure"
grep -q '^3 clients, pipelined: [0-9.]* tok/s' <<<"$out" || fail "no pipelined figure"
grep -q 'DIFFER' <<<"$out" && fail "the pipelined texts differ"
grep -q '^3 clients: waited .* pipelined .* tok/s' <<<"$out" || fail "no summary line"
echo "PASS"
