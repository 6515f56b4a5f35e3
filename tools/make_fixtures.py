#!/usr/bin/env python3
"""Reference fixtures for keel's DeepSeek-V4 forward pass.

Builds a few tiny random DeepSeek-V4 models, writes each one as an official-format
checkpoint (config.json + model.safetensors, official tensor names) and records what
transformers' DeepseekV4ForCausalLM computes on them (reference.safetensors): the
logits of one full forward, of prefill-then-decode through transformers' cache, and of
irregular chunked prefill, plus a few intermediates. See tools/README.md.

Needs only torch and transformers (5.17.0 is what the fixtures were made with); runs
on the CPU in float32. `--no-hf` skips transformers and writes only the checkpoints
(for checking names, shapes and formats with `keel inspect` where transformers is
not installed).

    python3 tools/make_fixtures.py --out OUT_DIR [--only NAME ...] [--no-hf]
"""

import argparse
import ctypes
import json
import math
import os
import sys
import time
import traceback

import torch

# ---------------------------------------------------------------------------------------
# Fixtures. Dimensions use keel's short names: V vocab, D hidden, H heads, hd head_dim,
# rd qk_rope_head_dim, q q_lora_rank, G o_groups, r o_lora_rank, sw sliding_window,
# nI/dI/topk indexer, hc hc_mult, E experts, k experts per token, I expert width.
# `ratios` is the official compress_ratios of the trunk (0 sliding, csa, hca).

FIXTURES = [
    dict(
        name="tiny",
        about="dsv4-forward.md section 10 config, float32",
        seed=1, V=97, D=64, ratios=[0, 4, 8, 4, 8], csa=4, hca=8, hash_layers=2, mtp=0,
        H=4, hd=32, rd=8, q=24, G=2, r=12, sw=8, nI=16, dI=16, topk=3,
        hc=4, hc_iters=20, hc_eps=1e-6, E=6, k=2, I=32,
        scoring="sqrtsoftplus", routed_scale=1.5, swiglu_limit=0.7, rms_eps=1e-6,
        rope_theta=10000.0, compress_rope_theta=160000.0,
        yarn=dict(factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0),
        max_pos=256, batch=2, seq=45, prefill=[1, 5, 13], chunks=[3, 7, 1, 9, 2, 5, 11, 7],
        quantized=False, transformers_copy=False, intermediates=True,
    ),
    dict(
        name="flashlike_sigmoid",
        about="Flash-like schedule (2 sliding, CSA/HCA alternating), sigmoid router, 3 hash layers, "
              "hc_mult 2, yarn with a fractional ramp, one MTP layer, float32",
        seed=2, V=61, D=32, ratios=[0, 0, 4, 8, 4, 8, 4], csa=4, hca=8, hash_layers=3, mtp=1,
        H=4, hd=16, rd=8, q=16, G=2, r=8, sw=12, nI=16, dI=8, topk=5,
        hc=2, hc_iters=10, hc_eps=1e-6, E=4, k=2, I=8,
        scoring="sigmoid", routed_scale=2.5, swiglu_limit=1.0, rms_eps=1e-6,
        rope_theta=5000.0, compress_rope_theta=10000.0,
        yarn=dict(factor=8.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0),
        max_pos=512, batch=2, seq=70, prefill=[1, 9, 33], chunks=[3, 7, 1, 9, 2, 5, 11, 7, 16, 1, 8],
        quantized=False, transformers_copy=True, intermediates=False,
    ),
    dict(
        name="tiny_quant",
        about="section 10 dims with o_groups 4 x 36 and one MTP layer; FP8 e4m3 128x128 ue8m0 dense "
              "linears (block (i, j) drawn x 2^((i + 2j) mod 3) so block scales differ), MXFP4 routed experts; "
              "reference = transformers on the dequantized weights",
        seed=3, V=97, D=64, ratios=[0, 4, 8, 4, 8], csa=4, hca=8, hash_layers=2, mtp=1,
        H=4, hd=32, rd=8, q=24, G=4, r=36, sw=8, nI=16, dI=16, topk=3,
        hc=4, hc_iters=20, hc_eps=1e-6, E=6, k=2, I=32,
        scoring="sqrtsoftplus", routed_scale=1.5, swiglu_limit=0.7, rms_eps=1e-6,
        rope_theta=10000.0, compress_rope_theta=160000.0,
        yarn=dict(factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0),
        max_pos=256, batch=2, seq=45, prefill=[1, 13], chunks=[3, 7, 1, 9, 2, 5, 11, 7],
        quantized=True, transformers_copy=False, intermediates=False,
    ),
]

TOLERANCE = 1e-5  # decode / chunked / no-cache logits vs the full forward

# ---------------------------------------------------------------------------------------
# safetensors, written and read by hand (no dependency beyond torch).

ST_DTYPES = {torch.float32: "F32", torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8", torch.int8: "I8"}
ST_TORCH = {"F32": torch.float32, "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8, "I8": torch.int8,
            "F8_E4M3": torch.uint8, "F8_E8M0": torch.uint8}


class Stored:
    """A tensor as stored: safetensors dtype name, shape, raw little-endian bytes."""

    def __init__(self, dtype, shape, data):
        self.dtype, self.shape, self.data = dtype, list(shape), data


def raw_bytes(t):
    t = t.detach().contiguous().cpu()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def stored(t, dtype=None):
    return Stored(dtype or ST_DTYPES[t.dtype], t.shape, raw_bytes(t))


def write_safetensors(path, tensors, metadata=None):
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, s in tensors.items():
        header[name] = {"dtype": s.dtype, "shape": s.shape, "data_offsets": [offset, offset + len(s.data)]}
        offset += len(s.data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for s in tensors.values():
            f.write(s.data)
    return os.path.getsize(path)


def read_safetensors(path):
    """name -> torch tensor (F8 types as uint8), and the metadata."""
    with open(path, "rb") as f:
        blob = f.read()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    meta = header.pop("__metadata__", {})
    out = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        buf = bytearray(blob[8 + n + b:8 + n + end])
        t = torch.frombuffer(buf, dtype=ST_TORCH[e["dtype"]]) if buf else torch.empty(0, dtype=ST_TORCH[e["dtype"]])
        out[name] = t.reshape(e["shape"])
    return out, meta


def write_index(directory, names, total_size):
    """model.safetensors.index.json, so that a loader opening the directory reads only
    model.safetensors (keel opens every *.safetensors of an unindexed directory)."""
    index = {"metadata": {"total_size": total_size}, "weight_map": {n: "model.safetensors" for n in names}}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, separators=(",", ":"))
        f.write("\n")


# ---------------------------------------------------------------------------------------
# Number formats (dsv4-checkpoint.md section 2). Codes are chosen round-to-nearest, ties
# to the even code, from tables of the representable magnitudes.


def e4m3_magnitude(code):  # FP8 E4M3FN, codes 0..126 (127 is NaN)
    e, m = (code >> 3) & 15, code & 7
    return m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)


E4M3 = torch.tensor([e4m3_magnitude(c) for c in range(127)], dtype=torch.float64)  # max 448
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)  # max 6


def nearest_codes(magnitude, table):
    """Round-to-nearest-even codes of non-negative float64 magnitudes, saturating."""
    last = len(table) - 1
    idx = torch.searchsorted(table, magnitude)
    hi, lo = idx.clamp(max=last), (idx - 1).clamp(min=0)
    d_lo, d_hi = magnitude - table[lo], table[hi] - magnitude
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.where(take_hi, hi, lo)


def ceil_log2(x):
    """ceil(log2(x)) for x > 0, exactly."""
    m, e = math.frexp(x)  # x = m * 2^e, 0.5 <= m < 1
    return e - 1 if m == 0.5 else e


def quantize_fp8_block(w, block=128):
    """w [out, in] f32 -> (codes u8 [out, in], scale bytes u8 [ceil(out/128), ceil(in/128)],
    dequantized f32). scale = 2^ceil(log2(max(amax, 1e-4) / 448)) per block."""
    out_f, in_f = w.shape
    rows, cols = -(-out_f // block), -(-in_f // block)
    codes = torch.zeros(out_f, in_f, dtype=torch.uint8)
    scales = torch.zeros(rows, cols, dtype=torch.uint8)
    deq = torch.zeros(out_f, in_f, dtype=torch.float32)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block].double()
            amax = max(float(blk.abs().max()), 1e-4)
            exp = ceil_log2(amax / 448.0)
            scale = 2.0 ** exp
            y = blk / scale
            mag = nearest_codes(y.abs(), E4M3)
            neg = y < 0
            codes[i * block:(i + 1) * block, j * block:(j + 1) * block] = (mag | (neg.long() << 7)).to(torch.uint8)
            value = E4M3[mag] * scale
            deq[i * block:(i + 1) * block, j * block:(j + 1) * block] = torch.where(neg, -value, value).float()
            scales[i, j] = exp + 127
    return codes, scales, deq


def quantize_mxfp4(w, block=32):
    """w [out, in] f32 -> (packed u8 [out, in/2], low nibble = even input; scale bytes u8
    [out, in/32]; dequantized f32). scale = 2^ceil(log2(max(amax, 6*2^-126) / 6))."""
    out_f, in_f = w.shape
    assert in_f % block == 0
    nb = in_f // block
    x = w.double().reshape(out_f, nb, block)
    amax = x.abs().amax(dim=2)
    exps = torch.tensor([[min(max(ceil_log2(max(float(a), 6 * 2.0 ** -126) / 6.0), -127), 127)
                          for a in row] for row in amax.tolist()], dtype=torch.float64)
    scale = torch.pow(2.0, exps).unsqueeze(2)
    y = x / scale
    mag = nearest_codes(y.abs().reshape(-1), E2M1).reshape(y.shape)
    neg = y < 0
    code = (mag | (neg.long() << 3)).reshape(out_f, in_f)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    value = E2M1[mag] * scale
    deq = torch.where(neg, -value, value).reshape(out_f, in_f).float()
    return packed, (exps + 127).to(torch.uint8), deq


def check_formats_against_torch(log):
    """Cross-checks the hand-written encoders with torch's float8 casts where torch has them."""
    try:
        return compare_with_torch_float8(log)
    except Exception as e:  # an older torch without these casts: not a fixture problem
        log(f"  format cross-check skipped: {type(e).__name__}: {e}")
        return 0


def compare_with_torch_float8(log):
    if not hasattr(torch, "float8_e4m3fn"):
        log("  (torch has no float8 dtypes; format cross-check skipped)")
        return 0
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(300, 200, generator=g) * 0.05
    w[0, :8] = torch.tensor([0.0, 1e-9, -3e-6, 448.0, -300.0, 17.0, 0.123, -2.0e-3])
    codes, scales, deq = quantize_fp8_block(w)
    bad = 0
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            s = 2.0 ** (int(scales[i, j]) - 127)
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            ref = (blk / s).to(torch.float8_e4m3fn).view(torch.uint8)
            bad += int((ref != codes[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]).sum())
    back = torch.zeros_like(w)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            s = 2.0 ** (int(scales[i, j]) - 127)
            c = codes[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            back[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = c.view(torch.float8_e4m3fn).float() * s
    bad_deq = int((back != deq).sum())
    if hasattr(torch, "float8_e8m0fnu"):
        e8 = torch.tensor([2.0 ** (int(b) - 127) for b in scales.reshape(-1)]).to(torch.float8_e8m0fnu)
        bad += int((e8.view(torch.uint8) != scales.reshape(-1)).sum())
    log(f"  fp8 encoder vs torch float8_e4m3fn/e8m0fnu casts: {bad} code mismatches, {bad_deq} dequant mismatches")
    return bad + bad_deq


# ---------------------------------------------------------------------------------------
# The official tensor list (mirrors src/keel/model/schema.cpp) and the random draw
# (dsv4-forward.md section 10): matrices N(0,1)/sqrt(fan_in), embedding N(0,1), norms
# 1+0.2N, sinks N(0,1), ape 0.5N, hc base 0.5N, hc scale 1+0.3N, router bias 0.3N,
# tid2eid rows of k distinct random experts.


def layer_kinds(fx):
    kinds = []
    for r in fx["ratios"] + [0] * fx["mtp"]:
        kinds.append({0: "sliding", fx["csa"]: "csa", fx["hca"]: "hca"}[r])
    return kinds


def official_specs(fx):
    """[(name, shape, role)] with role in matrix/dense/expert/embed/norm/param/table."""
    D, H, hd, q, G, r, E, I, hc, V = (fx[k] for k in ("D", "H", "hd", "q", "G", "r", "E", "I", "hc", "V"))
    specs = []

    def add(name, shape, role):
        specs.append((name, list(shape), role))

    add("embed.weight", [V, D], "embed")
    add("head.weight", [V, D], "matrix")
    add("norm.weight", [D], "norm")
    add("hc_head_fn", [hc, hc * D], "matrix")
    add("hc_head_base", [hc], "param")
    add("hc_head_scale", [1], "param")
    trunk = len(fx["ratios"])
    for L, kind in enumerate(layer_kinds(fx)):
        p = f"layers.{L}." if L < trunk else f"mtp.{L - trunk}."
        mix = (2 + hc) * hc
        for site in ("hc_attn", "hc_ffn"):
            add(p + site + "_fn", [mix, hc * D], "matrix")
            add(p + site + "_base", [mix], "param")
            add(p + site + "_scale", [3], "param")
        add(p + "attn_norm.weight", [D], "norm")
        add(p + "ffn_norm.weight", [D], "norm")
        a = p + "attn."
        add(a + "attn_sink", [H], "param")
        add(a + "wq_a.weight", [q, D], "dense")
        add(a + "q_norm.weight", [q], "norm")
        add(a + "wq_b.weight", [H * hd, q], "dense")
        add(a + "wkv.weight", [hd, D], "dense")
        add(a + "kv_norm.weight", [hd], "norm")
        add(a + "wo_a.weight", [G * r, H * hd // G], "dense")
        add(a + "wo_b.weight", [D, G * r], "dense")
        if kind == "csa":
            for prefix, dim in ((a + "compressor.", hd), (a + "indexer.compressor.", fx["dI"])):
                add(prefix + "ape", [fx["csa"], 2 * dim], "param")
                add(prefix + "wkv.weight", [2 * dim, D], "matrix")
                add(prefix + "wgate.weight", [2 * dim, D], "matrix")
                add(prefix + "norm.weight", [dim], "norm")
            add(a + "indexer.wq_b.weight", [fx["nI"] * fx["dI"], q], "dense")
            add(a + "indexer.weights_proj.weight", [fx["nI"], D], "matrix")
        elif kind == "hca":
            add(a + "compressor.ape", [fx["hca"], hd], "param")
            add(a + "compressor.wkv.weight", [hd, D], "matrix")
            add(a + "compressor.wgate.weight", [hd, D], "matrix")
            add(a + "compressor.norm.weight", [hd], "norm")
        f = p + "ffn."
        add(f + "gate.weight", [E, D], "matrix")
        if L < fx["hash_layers"] and L < trunk:
            add(f + "gate.tid2eid", [V, fx["k"]], "table")
        else:
            add(f + "gate.bias", [E], "param")
        for e in range(E):
            add(f + f"experts.{e}.w1.weight", [I, D], "expert")
            add(f + f"experts.{e}.w2.weight", [D, I], "expert")
            add(f + f"experts.{e}.w3.weight", [I, D], "expert")
        add(f + "shared_experts.w1.weight", [I, D], "dense")
        add(f + "shared_experts.w2.weight", [D, I], "dense")
        add(f + "shared_experts.w3.weight", [I, D], "dense")
        if L >= trunk:
            add(p + "e_proj.weight", [D, D], "dense")
            add(p + "h_proj.weight", [D, D], "dense")
            for n in ("enorm", "hnorm", "norm"):
                add(p + n + ".weight", [D], "norm")
            add(p + "hc_head_fn", [hc, hc * D], "matrix")
            add(p + "hc_head_base", [hc], "param")
            add(p + "hc_head_scale", [1], "param")
    return specs


def draw(name, shape, role, fx, g):
    if role == "table":
        rows = torch.stack([torch.randperm(fx["E"], generator=g)[:fx["k"]] for _ in range(shape[0])])
        return rows.to(torch.int64)
    z = torch.randn(*shape, generator=g, dtype=torch.float32)
    if role == "norm":
        return 1.0 + 0.2 * z
    if role == "embed":
        return z
    if role in ("matrix", "dense", "expert"):
        return z / math.sqrt(shape[-1])
    if name.endswith("attn_sink"):
        return z
    if name.endswith("ape") or name.endswith("_base"):
        return 0.5 * z
    if name.endswith("_scale"):
        return 1.0 + 0.3 * z
    if name.endswith("gate.bias"):
        return 0.3 * z
    raise ValueError(f"no init rule for {name}")


def vary_blocks(w, block=128):
    """Multiplies 128x128 block (i, j) by 2^((i + 2j) mod 3), so that the FP8 block scales of
    a multi-block matrix differ (an engine reading the wrong block's scale is then caught)."""
    w = w.clone()
    for i in range(-(-w.shape[0] // block)):
        for j in range(-(-w.shape[1] // block)):
            w[i * block:(i + 1) * block, j * block:(j + 1) * block] *= 2.0 ** ((i + 2 * j) % 3)
    return w


def make_weights(fx):
    """official name -> float tensor (the values transformers runs on: dequantized for the
    quantized fixture), and official name -> Stored (what model.safetensors holds)."""
    g = torch.Generator().manual_seed(fx["seed"])
    values, files = {}, {}
    for name, shape, role in official_specs(fx):
        t = draw(name, shape, role, fx, g)
        if fx["quantized"] and role == "dense":
            t = vary_blocks(t)
            codes, scales, deq = quantize_fp8_block(t)
            files[name] = Stored("F8_E4M3", codes.shape, raw_bytes(codes))
            files[name[:-len("weight")] + "scale"] = Stored("F8_E8M0", scales.shape, raw_bytes(scales))
            t = deq
        elif fx["quantized"] and role == "expert":
            packed, scales, deq = quantize_mxfp4(t)
            files[name] = Stored("I8", packed.shape, raw_bytes(packed))
            files[name[:-len("weight")] + "scale"] = Stored("F8_E8M0", scales.shape, raw_bytes(scales))
            t = deq
        else:
            files[name] = stored(t)
        values[name] = t
    return values, files


def official_config(fx):
    c = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": fx["V"],
        "hidden_size": fx["D"],
        "num_hidden_layers": len(fx["ratios"]),
        "num_attention_heads": fx["H"],
        "num_key_value_heads": 1,
        "head_dim": fx["hd"],
        "qk_rope_head_dim": fx["rd"],
        "q_lora_rank": fx["q"],
        "o_groups": fx["G"],
        "o_lora_rank": fx["r"],
        "sliding_window": fx["sw"],
        "compress_rate_csa": fx["csa"],
        "compress_rate_hca": fx["hca"],
        "compress_ratios": fx["ratios"] + [0] * fx["mtp"],
        "index_n_heads": fx["nI"],
        "index_head_dim": fx["dI"],
        "index_topk": fx["topk"],
        "hc_mult": fx["hc"],
        "hc_sinkhorn_iters": fx["hc_iters"],
        "hc_eps": fx["hc_eps"],
        "n_routed_experts": fx["E"],
        "n_shared_experts": 1,
        "num_experts_per_tok": fx["k"],
        "moe_intermediate_size": fx["I"],
        "num_hash_layers": fx["hash_layers"],
        "scoring_func": fx["scoring"],
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": fx["routed_scale"],
        "swiglu_limit": fx["swiglu_limit"],
        "rms_norm_eps": fx["rms_eps"],
        "rope_theta": fx["rope_theta"],
        "compress_rope_theta": fx["compress_rope_theta"],
        "rope_scaling": {"type": "yarn", **fx["yarn"]},
        "max_position_embeddings": fx["max_pos"],
        "num_nextn_predict_layers": fx["mtp"],
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
    }
    if fx["quantized"]:
        c["expert_dtype"] = "fp4"
        c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    return c


# ---------------------------------------------------------------------------------------
# Official -> transformers names (the inverse of src/keel/io/names.cpp; routed experts
# are fused: gate_up_proj[e] = [w1; w3], down_proj[e] = w2).

TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
IN_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale",
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}


def transformers_state(values, fx):
    """official values -> transformers state dict (MTP tensors have no transformers name)."""
    sd, experts = {}, {}
    for name, t in values.items():
        if name in TOP_LEVEL:
            sd[TOP_LEVEL[name]] = t
            continue
        if name.startswith("mtp."):
            continue
        _, layer, rest = name.split(".", 2)
        if rest.startswith("ffn.experts."):
            _, _, e, w, _ = rest.split(".")
            experts[(int(layer), int(e), w)] = t
            continue
        sd[f"model.layers.{layer}.{IN_LAYER[rest]}"] = t
    for L in range(len(fx["ratios"])):
        gate_up = [torch.cat([experts[(L, e, "w1")], experts[(L, e, "w3")]], dim=0) for e in range(fx["E"])]
        sd[f"model.layers.{L}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        sd[f"model.layers.{L}.mlp.experts.down_proj"] = torch.stack([experts[(L, e, "w2")] for e in range(fx["E"])])
    return sd


# ---------------------------------------------------------------------------------------
# transformers side


def import_transformers():
    import transformers
    try:
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    except ImportError:
        from transformers.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM
    return transformers, DeepseekV4Config, DeepseekV4ForCausalLM


def transformers_config(fx, Config):
    # Built from explicit transformers fields, not from the official key set: transformers
    # maps compress_ratios through a fixed {0, 4, 128} table, so this fixture's HCA ratio
    # (8) would not load from `compress_ratios`.
    kind_name = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
                 "hca": "heavily_compressed_attention"}
    n = len(fx["ratios"])
    cfg = Config(
        vocab_size=fx["V"], hidden_size=fx["D"], moe_intermediate_size=fx["I"], num_hidden_layers=n,
        num_attention_heads=fx["H"], num_key_value_heads=1, head_dim=fx["hd"], q_lora_rank=fx["q"],
        num_experts_per_tok=fx["k"], n_routed_experts=fx["E"], n_shared_experts=1,
        scoring_func=fx["scoring"], norm_topk_prob=True, routed_scaling_factor=float(fx["routed_scale"]),
        max_position_embeddings=fx["max_pos"], rope_theta=float(fx["rope_theta"]),
        layer_types=[kind_name[k] for k in layer_kinds(fx)[:n]],
        compress_rates={"compressed_sparse_attention": fx["csa"], "heavily_compressed_attention": fx["hca"]},
        compress_rope_theta=float(fx["compress_rope_theta"]),
        hc_mult=fx["hc"], hc_sinkhorn_iters=fx["hc_iters"], hc_eps=float(fx["hc_eps"]),
        mlp_layer_types=["hash_moe" if i < fx["hash_layers"] else "moe" for i in range(n)],
        swiglu_limit=float(fx["swiglu_limit"]), sliding_window=fx["sw"], o_groups=fx["G"], o_lora_rank=fx["r"],
        index_n_heads=fx["nI"], index_head_dim=fx["dI"], index_topk=fx["topk"],
        num_nextn_predict_layers=fx["mtp"], rms_norm_eps=float(fx["rms_eps"]), tie_word_embeddings=False,
        partial_rotary_factor=fx["rd"] / fx["hd"],
        rope_parameters={"rope_type": "yarn", "factor": float(fx["yarn"]["factor"]),
                         "original_max_position_embeddings": fx["yarn"]["original_max_position_embeddings"],
                         "beta_fast": float(fx["yarn"]["beta_fast"]), "beta_slow": float(fx["yarn"]["beta_slow"])},
        bos_token_id=0, eos_token_id=1,
    )
    cfg.architectures = ["DeepseekV4ForCausalLM"]
    return cfg


def expected_inv_freq(fx):
    """dsv4-forward.md 2.3: main = plain rope_theta, compress = compress_rope_theta + YaRN."""
    rd = fx["rd"]
    main = 1.0 / (fx["rope_theta"] ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
    base = fx["compress_rope_theta"]
    y = fx["yarn"]
    pos = base ** (torch.arange(0, rd, 2).float() / rd)

    def corr(rot):
        return rd * math.log(y["original_max_position_embeddings"] / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(y["beta_fast"])), 0), min(math.ceil(corr(y["beta_slow"])), rd - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rd // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extra = 1 - ramp
    compress = (1.0 / (y["factor"] * pos)) * (1 - extra) + (1.0 / pos) * extra
    return main, compress, (low, high)


def max_diff(a, b):
    return float((a - b).abs().max())


def use_eager_experts(model, log):
    """Switches the routed experts to transformers' plain per-expert loop ("eager"), the
    closest to what an engine computes; returns the implementation(s) now in use."""
    if hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation("eager")
        except Exception as e:
            log(f"  set_experts_implementation('eager') failed: {type(e).__name__}: {e}")
    for m in model.modules():
        if type(m).__name__ == "DeepseekV4Experts" and getattr(m.config, "_experts_implementation", None) != "eager":
            try:
                m.config._experts_implementation = "eager"
            except Exception as e:
                log(f"  cannot set _experts_implementation: {type(e).__name__}: {e}")
    return experts_implementations(model)


def experts_implementations(model):
    return ",".join(sorted({str(getattr(m.config, "_experts_implementation", None)) for m in model.modules()
                            if type(m).__name__ == "DeepseekV4Experts"}))


def run_transformers(fx, values, Model, Config, log):
    """Runs the reference model; returns (reference tensors, metadata, model)."""
    try:
        cfg = transformers_config(fx, Config)
    except Exception as e:  # fall back to the official key set with an explicit schedule
        log(f"  DeepseekV4Config(...) failed ({type(e).__name__}: {e}); trying from_dict(official keys)")
        d = official_config(fx)
        n = len(fx["ratios"])
        d.pop("compress_ratios")
        d["layer_types"] = [{"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
                             "hca": "heavily_compressed_attention"}[k] for k in layer_kinds(fx)[:n]]
        d["compress_rates"] = {"compressed_sparse_attention": fx["csa"], "heavily_compressed_attention": fx["hca"]}
        d["mlp_layer_types"] = ["hash_moe" if i < fx["hash_layers"] else "moe" for i in range(n)]
        cfg = Config.from_dict(d)
    log(f"  transformers config: layer_types={cfg.layer_types}")
    log(f"    mlp_layer_types={cfg.mlp_layer_types} compress_rates={cfg.compress_rates}")
    log(f"    rope_parameters={cfg.rope_parameters} qk_rope_head_dim={getattr(cfg, 'qk_rope_head_dim', None)}")
    torch.manual_seed(0)
    model = Model(cfg).to(torch.float32).eval()
    meta, problems = {}, []

    # RoPE frequencies against the spec.
    main, compress, (low, high) = expected_inv_freq(fx)
    rot = model.model.rotary_emb
    d_main = max_diff(rot.main_inv_freq.float(), main)
    d_comp = max_diff(rot.compress_inv_freq.float(), compress)
    log(f"  inv_freq vs dsv4-forward.md 2.3: main {d_main:.3g}, compress {d_comp:.3g} (yarn low {low}, high {high})")
    log(f"    compress inv_freq = {[float(v) for v in rot.compress_inv_freq]}")
    meta["inv_freq_main_vs_spec"] = f"{d_main:.3g}"
    meta["inv_freq_compress_vs_spec"] = f"{d_comp:.3g}"
    if d_main > 1e-6 * float(main.abs().max()) or d_comp > 1e-6 * float(compress.abs().max()):
        problems.append("inv_freq differs from the spec")

    # Weights.
    sd = transformers_state(values, fx)
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    shapes = sorted(k for k in sd if k in own and tuple(own[k].shape) != tuple(sd[k].shape))
    if missing or unexpected or shapes:
        log(f"  !! state dict: missing {missing}, unexpected {unexpected}, shape mismatch {shapes}")
        problems.append("state dict mismatch")
    model.load_state_dict({k: v for k, v in sd.items() if k in own and k not in shapes}, strict=False)
    if model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr():
        problems.append("lm_head is tied to embed_tokens")
    after = model.state_dict()
    reload_diff = max((max_diff(after[k].double(), sd[k].double()) for k in sd if k in after and k not in shapes),
                      default=0.0)
    log(f"  weights loaded: {len(sd)} tensors, max |loaded - intended| = {reload_diff}")
    if reload_diff != 0.0:
        problems.append("loaded weights differ")

    g = torch.Generator().manual_seed(1000 + fx["seed"])
    ids = torch.randint(0, fx["V"], (fx["batch"], fx["seq"]), generator=g)
    ref = {"input_ids": stored(ids.to(torch.int32))}

    # transformers' default experts backend once, for comparison; everything recorded
    # below runs the eager experts.
    default_impl = experts_implementations(model)
    try:
        default_logits = model(input_ids=ids, use_cache=True).logits.float()
    except Exception as e:
        log(f"  full forward with the default experts backend ({default_impl}) failed: {type(e).__name__}: {e}")
        default_logits = None
    impl = use_eager_experts(model, log)
    log(f"  experts backend: default {default_impl}, recorded with {impl}")
    meta["experts_implementation"] = impl
    if impl != "eager":
        problems.append(f"experts backend is {impl}, not eager")

    # One full forward (use_cache=True, the default: a fresh DynamicCache), with hooks on
    # each layer's attention and MoE outputs.
    captured = {"attn": [], "mlp": []}
    hooks = []
    if fx["intermediates"]:
        for layer in model.model.layers:
            hooks.append(layer.self_attn.register_forward_hook(lambda m, i, o: captured["attn"].append(o[0])))
            hooks.append(layer.mlp.register_forward_hook(lambda m, i, o: captured["mlp"].append(o)))
    full = model(input_ids=ids, use_cache=True).logits.float()
    for h in hooks:
        h.remove()
    ref["logits_full"] = stored(full.contiguous())
    if fx["intermediates"]:
        ref["attn_out_b0"] = stored(torch.stack([a[0] for a in captured["attn"]]).float().contiguous())
        ref["mlp_out_b0"] = stored(torch.stack([m[0] for m in captured["mlp"]]).float().contiguous())
        meta["attn_out_b0"] = ("[layer, seq, hidden]: batch row 0, output of self_attn (after o_b_proj, before "
                               "the mHC post/comb mix) in the full forward")
        meta["mlp_out_b0"] = ("[layer, seq, hidden]: batch row 0, output of the MoE block (routed + shared) "
                              "in the full forward")

    nocache = model(input_ids=ids, use_cache=False).logits.float()
    d_nocache = max_diff(nocache, full)
    if default_logits is not None:
        d_backend = max_diff(default_logits, full)
        log(f"  max |diff| default experts backend ({default_impl}) vs eager: {d_backend:.3g}")
        meta["max_abs_diff_default_experts_backend_vs_eager"] = f"{d_backend:.3g} ({default_impl})"

    decoded = []
    for P in fx["prefill"]:
        out = model(input_ids=ids[:, :P], use_cache=True)
        cache, parts = out.past_key_values, [out.logits.float()]
        for t in range(P, fx["seq"]):
            out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            parts.append(out.logits.float())
        decoded.append(torch.cat(parts, dim=1))
    decode = torch.stack(decoded)
    d_decode = [max_diff(d, full) for d in decoded]
    ref["logits_decode"] = stored(decode.contiguous())

    assert sum(fx["chunks"]) == fx["seq"]
    cache, parts, pos = None, [], 0
    for n in fx["chunks"]:
        out = model(input_ids=ids[:, pos:pos + n], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        parts.append(out.logits.float())
        pos += n
    chunked = torch.cat(parts, dim=1)
    d_chunked = max_diff(chunked, full)
    ref["logits_chunked"] = stored(chunked.contiguous())

    log(f"  max |logits|: {float(full.abs().max()):.4g}")
    log(f"  max |diff| vs full forward: no-cache {d_nocache:.3g}; decode after prefill "
        + ", ".join(f"P={P}: {d:.3g}" for P, d in zip(fx["prefill"], d_decode))
        + f"; chunked {d_chunked:.3g}")
    for what, d in [("no-cache", d_nocache), ("chunked", d_chunked)] + \
                   [(f"decode P={P}", d) for P, d in zip(fx["prefill"], d_decode)]:
        if not d <= TOLERANCE:
            problems.append(f"{what} differs from the full forward by {d:.3g}")

    meta.update({
        "logits_full": "[batch, seq, vocab]: one forward over the whole sequence (fresh cache, use_cache=True)",
        "logits_decode": "[len(decode_prefill), batch, seq, vocab]: row i = one call over the first "
                         "decode_prefill[i] tokens, then one call per token through the same cache",
        "logits_chunked": "[batch, seq, vocab]: calls over consecutive chunks of the sizes in `chunks`, one cache",
        "decode_prefill": ",".join(map(str, fx["prefill"])),
        "chunks": ",".join(map(str, fx["chunks"])),
        "max_abs_diff_nocache_vs_full": f"{d_nocache:.3g}",
        "max_abs_diff_decode_vs_full": ",".join(f"{d:.3g}" for d in d_decode),
        "max_abs_diff_chunked_vs_full": f"{d_chunked:.3g}",
        "max_abs_logit": f"{float(full.abs().max()):.4g}",
    })
    return ref, meta, model, problems


# ---------------------------------------------------------------------------------------


def make_fixture(fx, out_dir, hf, log):
    name = fx["name"]
    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    log(f"== {name}: {fx['about']}")
    t0 = time.time()
    values, files = make_weights(fx)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(official_config(fx), f, indent=2)
        f.write("\n")
    size = write_safetensors(os.path.join(d, "model.safetensors"), files, {"format": "pt"})
    write_index(d, list(files), sum(len(s.data) for s in files.values()))
    log(f"  model.safetensors: {len(files)} tensors, {size} bytes")
    problems = []
    if hf is None:
        return problems
    transformers, Config, Model = hf
    ref, meta, model, problems = run_transformers(fx, values, Model, Config, log)
    meta.update({
        "format": "pt",
        "fixture": name,
        "about": fx["about"],
        "seed": str(fx["seed"]),
        "input_ids_seed": str(1000 + fx["seed"]),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": "cpu",
        "dtype": "float32",
        "generator": "tools/make_fixtures.py",
        "self_check": "ok" if not problems else "; ".join(problems),
    })
    size = write_safetensors(os.path.join(d, "reference.safetensors"), ref, meta)
    log(f"  reference.safetensors: {size} bytes")
    hf_state = {k: stored(v.float() if v.is_floating_point() else v) for k, v in model.state_dict().items()}
    if fx["transformers_copy"]:
        td = os.path.join(d, "transformers")
        os.makedirs(td, exist_ok=True)
        try:
            model.config.save_pretrained(td)
        except Exception as e:
            log(f"  config.save_pretrained failed ({type(e).__name__}: {e}); writing to_dict() instead")
            with open(os.path.join(td, "config.json"), "w") as f:
                json.dump(model.config.to_dict(), f, indent=2, default=str)
        size = write_safetensors(os.path.join(td, "model.safetensors"), hf_state, {"format": "pt"})
        log(f"  transformers/model.safetensors: {len(hf_state)} tensors, {size} bytes")
    else:  # kept for debugging only; not part of the committed fixtures
        dbg = os.path.join(out_dir, "_debug")
        os.makedirs(dbg, exist_ok=True)
        write_safetensors(os.path.join(dbg, f"{name}.transformers.safetensors"), hf_state, {"format": "pt"})
    log(f"  {name}: {'OK' if not problems else 'PROBLEMS: ' + '; '.join(problems)} ({time.time() - t0:.1f} s)")
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory to write the fixtures into")
    ap.add_argument("--only", nargs="*", help="fixture names (default: all)")
    ap.add_argument("--no-hf", action="store_true", help="write the checkpoints only, without transformers")
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, "make_fixtures.log"), "a")

    def log(msg):
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    log(f"python {sys.version.split()[0]}, torch {torch.__version__}")
    hf = None
    if not args.no_hf:
        hf = import_transformers()
        log(f"transformers {hf[0].__version__} (fixtures were made with 5.17.0)")
    bad = check_formats_against_torch(log)
    failed = []
    if bad:
        failed.append("format cross-check")
    for fx in FIXTURES:
        if args.only and fx["name"] not in args.only:
            continue
        try:
            if make_fixture(fx, args.out, hf, log):
                failed.append(fx["name"])
        except Exception:
            log(traceback.format_exc())
            failed.append(fx["name"])
    log("failed: " + ", ".join(failed) if failed else "all fixtures OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
