#!/usr/bin/env python3
"""Reference fixture for keel's MTP (next-n prediction) layer on keel-tiny-v4.

Reads the committed official-format checkpoint (models/keel-tiny-v4: FP8 e4m3 128x128
block-scaled dense linears, MXFP4 routed experts, BF16/F32 elsewhere, `mtp.0.*`),
dequantizes it to float32 with this script's own decoders (dsv4-checkpoint.md section 2),
loads it into tools/train_tiny.py's transformers trunk + MTP layer (`load_into`, eager
experts) and runs train_tiny's `Runner` on the 96 tokens of
tests/fixtures/keel_tiny_v4_reference.safetensors, in float32 on the CPU.

Checks (all logged; the exit status is 0 only if every one passes):
- the decoders: every dequantized FP8 / MXFP4 tensor is re-quantized with make_fixtures.py's
  quantizers and compared with the stored codes and scales, and FP8 is also decoded
  through torch's float8 dtypes where torch has them;
- the trunk logits against the `logits` of keel_tiny_v4_reference.safetensors;
- the MTP logits of a shorter run (the sequence cut after the token the MTP reads) against
  the full run's, at the two stream positions (the MTP row must not see later tokens);
- where a GPU is present, the same run on the GPU (float32, TF32 off) against the CPU's.

Writes tests/fixtures/keel_tiny_v4_mtp_reference.safetensors (see tools/README.md):
`input_ids`, `positions`, `mtp_logits`, `mtp_argmax`, `stream_positions`, `streams`.

    python3 tools/make_mtp_fixture.py --out FILE [--model models/keel-tiny-v4]
    python3 tools/make_mtp_fixture.py --decode-only    # the decoder checks alone (no transformers)
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402  (safetensors reader/writer, quantizers, official names)
import train_tiny as tt  # noqa: E402  (keel-tiny-v4's dimensions, MTP, Runner, load_into)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FX = dict(tt.MODEL)

TRUNK_TOLERANCE = 1e-4   # trunk logits vs keel_tiny_v4_reference.safetensors (a GPU run)
PREFIX_TOLERANCE = 1e-4  # MTP logits of the cut sequence vs the full one
GPU_TOLERANCE = 1e-4     # GPU (TF32 off) vs CPU

# The MTP positions recorded: every 7th position from 2 (MTP rows exist for 0..S-2 = 94).
POSITIONS = list(range(2, 95, 7))
STREAM_POSITIONS = [30, 93]  # one inside the first sliding window (64), one past it


def log(msg):
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------
# Decoders (dsv4-checkpoint.md section 2), written independently of make_fixtures.py's
# encoders.


def e8m0_to_float(scale_bytes):
    """UE8M0 byte e -> 2^(e - 127); 255 is NaN (refused)."""
    s = scale_bytes.to(torch.int64)
    assert not bool((s == 255).any()), "E8M0 NaN scale"
    return torch.pow(torch.tensor(2.0, dtype=torch.float64), (s - 127).to(torch.float64))


def e4m3_to_float(codes):
    """FP8 E4M3FN codes (uint8) -> float64: sign | 4 exponent bits (bias 7) | 3 mantissa
    bits; exponent 0 is subnormal (m/8 * 2^-6); 0x7F / 0xFF are NaN (refused)."""
    c = codes.to(torch.int64)
    assert not bool(((c & 0x7F) == 0x7F).any()), "E4M3 NaN code"
    sign = torch.where((c >> 7) == 1, -1.0, 1.0).to(torch.float64)
    e = ((c >> 3) & 15).to(torch.float64)
    m = (c & 7).to(torch.float64)
    normal = (1.0 + m / 8.0) * torch.pow(2.0, e - 7.0)
    sub = (m / 8.0) * 2.0 ** -6
    return sign * torch.where(e == 0, sub, normal)


E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float64)


def dequant_fp8(codes, scales, block=128):
    """W[n, k] = e4m3(q[n, k]) * 2^(S[n // 128, k // 128] - 127)."""
    out_f, in_f = codes.shape
    assert list(scales.shape) == [-(-out_f // block), -(-in_f // block)], (codes.shape, scales.shape)
    s = e8m0_to_float(scales).repeat_interleave(block, 0)[:out_f].repeat_interleave(block, 1)[:, :in_f]
    return (e4m3_to_float(codes) * s).to(torch.float32)


def dequant_mxfp4(packed, scales, block=32):
    """packed [out, in/2]: byte j holds input 2j in the low nibble and 2j+1 in the high one;
    W[n, k] = e2m1(nibble) * 2^(S[n, k // 32] - 127)."""
    p = packed.view(torch.uint8).to(torch.int64)
    out_f, half = p.shape
    in_f = 2 * half
    assert list(scales.shape) == [out_f, in_f // block], (packed.shape, scales.shape)
    nib = torch.empty(out_f, in_f, dtype=torch.int64)
    nib[:, 0::2] = p & 15
    nib[:, 1::2] = p >> 4
    s = e8m0_to_float(scales).repeat_interleave(block, 1)
    return (E2M1_VALUES[nib] * s).to(torch.float32)


def read_checkpoint(model_dir):
    """official name -> float32 tensor (tid2eid int64), and per-tensor formats."""
    # make_fixtures' reader knows no BF16 (its own files have none); this process adds it.
    mf.ST_TORCH.setdefault("BF16", torch.bfloat16)
    index = json.load(open(os.path.join(model_dir, "model.safetensors.index.json")))
    raw = {}
    for fname in sorted(set(index["weight_map"].values())):
        path = os.path.join(model_dir, fname)
        tensors, _ = mf.read_safetensors(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for name, t in tensors.items():
            raw[name] = (header[name]["dtype"], t)
    assert set(raw) == set(index["weight_map"]), "index and files disagree"
    values, formats = {}, {}
    for name, (dtype, t) in raw.items():
        if name.endswith(".scale"):
            continue
        if dtype == "F8_E4M3":
            sdt, s = raw[name[:-len("weight")] + "scale"]
            assert sdt == "F8_E8M0"
            values[name] = dequant_fp8(t, s)
        elif dtype == "I8":
            sdt, s = raw[name[:-len("weight")] + "scale"]
            assert sdt == "F8_E8M0"
            values[name] = dequant_mxfp4(t, s)
        elif dtype == "BF16":
            values[name] = t.float()
        elif dtype == "F32":
            values[name] = t.clone()
        elif dtype == "I64":
            values[name] = t.clone()
        else:
            raise ValueError(f"{name}: unexpected dtype {dtype}")
        formats[name] = dtype
    scales = [n for n in raw if n.endswith(".scale")]
    assert all(formats.get(n[:-len("scale")] + "weight") in ("F8_E4M3", "I8") for n in scales)
    return values, formats, raw


def check_decoders(values, formats, raw):
    """Re-quantizes every dequantized tensor with make_fixtures' quantizers and compares.
    A block whose amax rounded down onto the lower edge of its range (FP8 224*s, MXFP4
    3*s) re-quantizes with half the scale: its codes then differ while the values they
    decode to are the same, so such blocks are counted apart and checked by value. A stored
    -0 code (sign bit alone) decodes to 0.0 and re-quantizes as +0; those are counted apart too."""
    ok = True
    for fmt in ("F8_E4M3", "I8"):
        names = [n for n in sorted(values) if formats[n] == fmt]
        blocks = same_scale = lower_scale = code_mismatch = value_mismatch = bad_scale = zero_sign = 0
        for name in names:
            codes = raw[name][1].view(torch.uint8)
            scales = raw[name[:-len("weight")] + "scale"][1].view(torch.uint8)
            w = values[name]
            if fmt == "F8_E4M3":
                c2, s2, d2 = mf.quantize_fp8_block(w)
                per_elem_scale = s2.to(torch.int64).repeat_interleave(128, 0)[:w.shape[0]] \
                    .repeat_interleave(128, 1)[:, :w.shape[1]]
                per_elem_stored = scales.to(torch.int64).repeat_interleave(128, 0)[:w.shape[0]] \
                    .repeat_interleave(128, 1)[:, :w.shape[1]]
                codes_elem, c2_elem = codes, c2
            else:
                c2, s2, d2 = mf.quantize_mxfp4(w)
                per_elem_scale = s2.to(torch.int64).repeat_interleave(32, 1)
                per_elem_stored = scales.to(torch.int64).repeat_interleave(32, 1)
                # compare nibbles, element by element
                p, q = codes.to(torch.int64), c2.to(torch.int64)
                codes_elem = torch.stack([p & 15, p >> 4], dim=2).reshape(w.shape)
                c2_elem = torch.stack([q & 15, q >> 4], dim=2).reshape(w.shape)
            blocks += scales.numel()
            same_scale += int((s2.to(torch.int64) == scales.to(torch.int64)).sum())
            lower_scale += int((s2.to(torch.int64) == scales.to(torch.int64) - 1).sum())
            bad_scale += int(((s2.to(torch.int64) != scales.to(torch.int64))
                              & (s2.to(torch.int64) != scales.to(torch.int64) - 1)).sum())
            eq = per_elem_scale == per_elem_stored
            a, b = codes_elem.to(torch.int64)[eq], c2_elem.to(torch.int64)[eq]
            # -0 (sign bit alone) decodes to 0.0, which the quantizer writes as +0.
            sign_bit = 0x80 if fmt == "F8_E4M3" else 0x8
            neg_zero = (a == sign_bit) & (b == 0)
            zero_sign += int(neg_zero.sum())
            code_mismatch += int(((a != b) & ~neg_zero).sum())
            value_mismatch += int((d2 != w).sum())
        what = "FP8 e4m3 128x128" if fmt == "F8_E4M3" else "MXFP4 e2m1/32"
        good = code_mismatch == 0 and value_mismatch == 0 and bad_scale == 0
        ok &= good
        log(f"decoder check {what}: {len(names)} tensors, {blocks} blocks; re-quantized scale equal in "
            f"{same_scale} blocks (codes differing there: {code_mismatch}, besides {zero_sign} stored -0 codes "
            f"that re-quantize as +0), one exponent lower in {lower_scale} "
            f"(amax on the range's lower edge), other: {bad_scale}; re-quantized values differing from the "
            f"decoded ones: {value_mismatch} -> {'ok' if good else 'FAILED'}")
    # FP8 through torch's own float8 dtypes, where this torch has them.
    if hasattr(torch, "float8_e4m3fn") and hasattr(torch, "float8_e8m0fnu"):
        worst = 0.0
        for name in sorted(values):
            if formats[name] != "F8_E4M3":
                continue
            codes = raw[name][1].view(torch.uint8).contiguous()
            scales = raw[name[:-len("weight")] + "scale"][1].view(torch.uint8).contiguous()
            q = codes.view(torch.float8_e4m3fn).float()
            s = scales.view(torch.float8_e8m0fnu).float()
            s = s.repeat_interleave(128, 0)[:q.shape[0]].repeat_interleave(128, 1)[:, :q.shape[1]]
            worst = max(worst, float((q * s - values[name]).abs().max()))
        ok &= worst == 0.0
        log(f"decoder check FP8 vs torch float8_e4m3fn * float8_e8m0fnu: max |diff| {worst:.3g} -> "
            f"{'ok' if worst == 0.0 else 'FAILED'}")
    else:
        log("decoder check FP8 vs torch float8 dtypes: skipped (this torch has none)")
    return ok


def check_config(model_dir):
    """The committed config.json is what train_tiny's MODEL exports."""
    want = mf.official_config(dict(FX, quantized=True))
    want["torch_dtype"] = "bfloat16"
    have = json.load(open(os.path.join(model_dir, "config.json")))
    same = json.loads(json.dumps(want)) == have
    log(f"config.json equals train_tiny.MODEL's official config: {same}")
    return same


def max_diff(a, b):
    return float((a.double() - b.double()).abs().max())


# ---------------------------------------------------------------------------------------


@torch.no_grad()
def run_model(values, ids, device, Config, Model, mdl):
    """Trunk logits [S, V], MTP logits [S-1, V] and pre-hc_head streams [S, hc, D]."""
    model, mtp = tt.load_into(values, FX, Config, Model, mdl, device)
    runner = tt.Runner(model, mtp)
    x = ids.to(device)
    logits, mlog = runner(x)
    streams = runner.cap["streams"]
    out = (logits[0].float().cpu(), mlog[0].float().cpu(), streams[0].float().cpu().clone())
    # The MTP row at p must not depend on tokens after p+1: a run of ids[:p+2] gives it too.
    prefix = {}
    for p in STREAM_POSITIONS:
        _, m2 = runner(x[:, :p + 2])
        prefix[p] = max_diff(m2[0, p].float().cpu(), out[1][p])
    return out, prefix, model, mtp


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(REPO, "models/keel-tiny-v4"))
    ap.add_argument("--reference", default=os.path.join(REPO, "tests/fixtures/keel_tiny_v4_reference.safetensors"))
    ap.add_argument("--out", default=os.path.join(REPO, "tests/fixtures/keel_tiny_v4_mtp_reference.safetensors"))
    ap.add_argument("--decode-only", action="store_true", help="the decoder and config checks only")
    ap.add_argument("--no-gpu-check", action="store_true", help="skip the GPU cross-check")
    args = ap.parse_args()
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    log(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")

    values, formats, raw = read_checkpoint(args.model)
    counts = {}
    for f in formats.values():
        counts[f] = counts.get(f, 0) + 1
    log(f"checkpoint: {len(values)} tensors {counts}, {sum(n.startswith('mtp.0.') for n in values)} of them mtp.0.*")
    specs = {n for n, _, _ in mf.official_specs(FX)}
    names_ok = specs == set(values)
    log(f"tensor names equal official_specs(train_tiny.MODEL): {names_ok}")
    ok = check_config(args.model) & names_ok
    ok &= check_decoders(values, formats, raw)
    if args.decode_only:
        log(f"decode-only: {'ok' if ok else 'FAILED'} ({time.time() - t0:.1f} s)")
        return 0 if ok else 1

    transformers, Config, Model, mdl = tt.import_hf()
    log(f"transformers {transformers.__version__}")
    ref, _ = mf.read_safetensors(args.reference)
    ids = ref["input_ids"].to(torch.long)
    assert list(ids.shape) == [1, 96], ids.shape
    S = ids.shape[1]

    (logits, mlog, streams), prefix, _, _ = run_model(values, ids, "cpu", Config, Model, mdl)
    ref_pos = ref["positions"].to(torch.long)
    d_trunk = max_diff(logits[ref_pos], ref["logits"])
    argmax_same = int((logits.argmax(-1).to(torch.int32) == ref["argmax"]).sum())
    log(f"trunk vs reference logits at {ref_pos.tolist()}: max |diff| {d_trunk:.3g} "
        f"(max |logit| {float(ref['logits'].abs().max()):.3g}); argmax equal at {argmax_same}/{S} positions")
    ok &= d_trunk <= TRUNK_TOLERANCE
    for p, d in prefix.items():
        log(f"MTP row {p}: run over ids[:{p + 2}] vs full run: max |diff| {d:.3g}")
        ok &= d <= PREFIX_TOLERANCE

    assert list(mlog.shape) == [S - 1, FX["V"]]
    mtp_argmax = mlog.argmax(-1).to(torch.int32)
    hits = int((mtp_argmax[:S - 2] == ids[0, 2:].to(torch.int32)).sum())
    log(f"MTP argmax equals token i+2 at {hits}/{S - 2} positions (i = 0..{S - 3})")
    pos = torch.tensor(POSITIONS, dtype=torch.long)
    spos = torch.tensor(STREAM_POSITIONS, dtype=torch.long)
    assert all(p in POSITIONS for p in STREAM_POSITIONS)
    mtp_logits = mlog[pos].contiguous()
    log(f"MTP max |logit| at the positions: {float(mtp_logits.abs().max()):.3g}")

    checks = {"max_abs_diff_trunk_vs_reference": f"{d_trunk:.3g}",
              "max_abs_diff_mtp_prefix_run": json.dumps({str(p): float(f"{d:.3g}") for p, d in prefix.items()})}
    device_note = "cpu"
    if torch.cuda.is_available() and not args.no_gpu_check:
        (g_logits, g_mlog, g_streams), g_prefix, _, _ = run_model(values, ids, "cuda", Config, Model, mdl)
        d = {"trunk_logits": max_diff(g_logits, logits), "mtp_logits": max_diff(g_mlog, mlog),
             "streams": max_diff(g_streams, streams),
             "trunk_vs_reference": max_diff(g_logits[ref_pos], ref["logits"])}
        log("GPU (float32, TF32 off) vs CPU: " + ", ".join(f"{k} {v:.3g}" for k, v in d.items())
            + f"; GPU MTP argmax equal at {int((g_mlog.argmax(-1).to(torch.int32) == mtp_argmax).sum())}/{S - 1}")
        ok &= d["mtp_logits"] <= GPU_TOLERANCE and d["trunk_logits"] <= GPU_TOLERANCE
        checks["max_abs_diff_gpu_vs_cpu_mtp_logits"] = f"{d['mtp_logits']:.3g}"
        checks["max_abs_diff_gpu_trunk_vs_reference"] = f"{d['trunk_vs_reference']:.3g}"
        device_note = f"cpu (cross-checked on {torch.cuda.get_device_name(0)})"

    tensors = {
        "input_ids": mf.stored(ids.to(torch.int32).contiguous()),
        "positions": mf.stored(pos.to(torch.int32)),
        "mtp_logits": mf.stored(mtp_logits.float()),
        "mtp_argmax": mf.stored(mtp_argmax.contiguous()),
        "stream_positions": mf.stored(spos.to(torch.int32)),
        "streams": mf.stored(streams[spos].contiguous().float()),
    }
    meta = {
        "format": "pt", "generator": "tools/make_mtp_fixture.py",
        "about": "models/keel-tiny-v4 dequantized to float32, loaded into train_tiny.py's transformers "
                 "DeepseekV4ForCausalLM + MTP layer (float32, CPU, eager experts), run on input_ids "
                 "(those of keel_tiny_v4_reference.safetensors). The MTP row at position i takes the "
                 "trunk's streams at i (after the last layer, before hc_head) and token input_ids[i+1], "
                 "at position i with its own sliding window over rows 0..i, and predicts input_ids[i+2]",
        "input_ids": "I32 [1, 96]",
        "positions": "I32 [P]: MTP positions i of mtp_logits",
        "mtp_logits": "F32 [P, V]: MTP logits at positions",
        "mtp_argmax": "I32 [95]: argmax of the MTP logits at every position 0..94",
        "stream_positions": "I32 [2]",
        "streams": "F32 [2, hc, D]: trunk streams before hc_head at stream_positions",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "device": device_note, "dtype": "float32", "experts_implementation": "eager",
        "self_check": "ok" if ok else "FAILED", **checks,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    size = mf.write_safetensors(args.out, tensors, meta)
    log(f"wrote {args.out}: {size} bytes; positions {POSITIONS}; stream positions {STREAM_POSITIONS}")
    log(f"self-check: {'ok' if ok else 'FAILED'} ({time.time() - t0:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
