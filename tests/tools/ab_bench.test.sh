#!/usr/bin/env bash
# tools/ab_bench.py with --trace, and tools/gpu_timeline.py's comparison under it (and its
# --own table of one trace), against
# a stand-in keel: build B's "gate" kernel takes 3.5 us where A's takes 7, 60 times a step,
# and the tracer is a file the stand-in only checks is named (no GPU, no CUPTI).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

cat >"$work/keel" <<'PY'
#!/usr/bin/env python3
import json, os, sys
gate = float(os.environ.get("GATE_US", "7.0"))
if sys.argv[1] == "bench":
    trace = os.environ.get("KEEL_GPU_TRACE")
    if trace and os.path.exists(os.environ.get("CUDA_INJECTION64_PATH", "")):
        rows, t, c = ["kind,start_ns,end_ns,stream,correlation,name"], 0, 1
        for step in range(10):
            for layer in range(60):
                for name, us in (("gate", gate), ("experts", 20.0)):
                    rows.append(f"kernel,{t},{t + int(us * 1000)},7,{c},{name}")
                    c, t = c + 1, t + int(us * 1000) + 1000
            rows.append(f"memcpy,{t},{t + 3000},7,{c},64 bytes kind 2")
            c, t = c + 1, t + 50000
        with open(trace, "w") as f:
            f.write("\n".join(rows) + "\n")
    print(json.dumps({"prefill_tok_s": 1000.0, "decode_tok_s": 1e3 / (1.0 + 0.06 * gate), "bandwidth_share": 0.4,
                      "batched": [], "prefill": [], "speculative": [], "memory_read_gb_s": 4000.0}))
PY
chmod +x "$work/keel"
printf '#!/bin/sh\nGATE_US=3.5 exec "%s" "$@"\n' "$work/keel" >"$work/keel-b"
chmod +x "$work/keel-b"
: >"$work/libtrace.so"

python3 "$root/tools/ab_bench.py" --rounds 2 --trace "$work/libtrace.so" --trace-dir "$work/traces" \
  "$work/keel" "$work/keel-b" -- --model none >"$work/out" 2>"$work/err" || { cat "$work/err"; fail "ab_bench failed"; }
cat "$work/out"
grep -q '^decode ms/token .* B/A -14.8% +$' "$work/out" || fail "the decode line"
grep -q '^median step span: A 1743.0 us (10 steps), B 1533.0 us (10 steps), B - A -210.0 us' "$work/out" ||
  fail "the traced step's span"
grep -Eq '^ +420.0 +60 +210.0 +60 +-210.0  gate$' "$work/out" || fail "the gate's line"
grep -Eq '^ +1200.0 +60 +1200.0 +60 +\+0.0  experts$' "$work/out" || fail "the experts' line"
# One trace alone (--own): the same times, largest first.
python3 "$root/tools/gpu_timeline.py" "$work/traces/A.csv" --own >"$work/own" || fail "gpu_timeline --own failed"
cat "$work/own"
diff <(grep -E '^ +[0-9]' "$work/own") - <<'TXT' || fail "gpu_timeline --own's table"
    1200.0   60  experts
     420.0   60  gate
       3.0    1  memcpy 64 bytes kind 2
    1623.0       (all)
TXT
echo "ab_bench --trace: as expected"
