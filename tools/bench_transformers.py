#!/usr/bin/env python3
"""The transformers baseline for `keel bench`: prefill and decode speed of transformers'
DeepseekV4ForCausalLM (eager attention, bf16, one GPU) on an official-format DeepSeek-V4
checkpoint, such as one written by `keel synth`. See tools/README.md.

Every FP8 (128x128 block, ue8m0 scale) and MXFP4 weight is dequantized to bf16, the values
keel computes with. The modules that from_pretrained(dtype=bfloat16) keeps in float32
(`_keep_in_fp32_modules_strict`) are tried in float32 first; transformers 5.17.0's forward
refuses them (a float32 RMSNorm output meets a bf16 linear), so there everything runs in
bf16 and the JSON says so. The checkpoint is read one tensor at a time from memory-mapped
shards and dequantized on the GPU, so host memory holds no copy of the model. MTP layers
are skipped (transformers has none).

Timed as `keel bench` times: prefill = one forward over a random prompt (fresh cache)
and the greedy choice of the next token; decode = N greedy steps through transformers'
cache, one token per forward; batched = B random prompts prefilled together, then N
steps of B tokens each. Best of --runs, torch.cuda.synchronize around each timed span.
Prints one JSON object on stdout; progress goes to stderr.

    python3 tools/bench_transformers.py --model DIR [--prompt 512] [--decode 16] [--runs 2]
        [--batch 1,8] [--batch-prompt 32] [--experts eager[,grouped_mm]]
"""

import argparse
import json
import mmap
import os
import re
import sys
import time


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="official-format checkpoint directory (config.json + safetensors)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens of the single-sequence run")
    ap.add_argument("--decode", type=int, default=16, help="greedy decode steps after each prompt")
    ap.add_argument("--runs", type=int, default=2, help="timed runs; the best is reported")
    ap.add_argument("--batch", default="", help="batch sizes for batched decode, comma-separated (e.g. 1,8)")
    ap.add_argument("--batch-prompt", type=int, default=32, help="prompt tokens of each sequence in the batched runs")
    ap.add_argument("--experts", default="eager",
                    help="transformers experts implementations to time, comma-separated (eager, grouped_mm, ...); "
                         "the first gives the top-level figures")
    ap.add_argument("--device", default="cuda", help="torch device (cuda, cuda:N; cpu only for tiny checkpoints)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the random prompts")
    args = ap.parse_args()
    args.batch = [int(b) for b in args.batch.split(",") if b.strip()]
    args.experts = [e.strip() for e in args.experts.split(",") if e.strip()]
    if min([args.prompt, args.decode, args.runs, args.batch_prompt] + args.batch) < 1 or not args.experts:
        ap.error("--prompt, --decode, --runs, --batch and --batch-prompt must be positive, --experts non-empty")
    return args


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# torch and make_fixtures (which imports torch) are imported after the arguments are
# parsed, so that --help works where torch is not installed.
torch = mf = None


def import_torch():
    global torch, mf
    import torch as _torch
    torch = _torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import make_fixtures as _mf  # safetensors dtypes, number formats, official names, transformers config
    mf = _mf


# ---------------------------------------------------------------------------------------
# Checkpoint: one tensor at a time from memory-mapped shards.


class Checkpoint:
    """The tensors of an official-format checkpoint directory (sharded with
    model.safetensors.index.json, or every *.safetensors in it), read lazily."""

    def __init__(self, directory):
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
        if not files:
            raise SystemExit(f"{directory}: no safetensors files")
        # I8 holds packed FP4 nibbles and F8_* raw codes: all read as bytes.
        self.dtypes = {**mf.ST_TORCH, "BF16": torch.bfloat16, "F16": torch.float16, "I8": torch.uint8}
        self.entries, self.bytes = {}, 0
        for name in files:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                # A private mapping is writable, which torch.frombuffer wants; nothing writes to it.
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            n = int.from_bytes(mm[:8], "little")
            header = json.loads(mm[8:8 + n])
            header.pop("__metadata__", None)
            for tensor, e in header.items():
                begin, end = e["data_offsets"]
                self.entries[tensor] = (mm, e["dtype"], list(e["shape"]), 8 + n + begin, end - begin)
                self.bytes += end - begin

    def names(self):
        return list(self.entries)

    def dtype(self, name):
        return self.entries[name][1]

    def shape(self, name):
        return self.entries[name][2]

    def get(self, name, device):
        """The stored tensor on `device` (F8/I8 as uint8 bytes)."""
        mm, dtype, shape, offset, size = self.entries[name]
        t_dtype = self.dtypes[dtype]
        count = size // torch.empty(0, dtype=t_dtype).element_size()
        if count == 0:
            return torch.empty(shape, dtype=t_dtype, device=device)
        t = torch.frombuffer(mm, dtype=t_dtype, count=count, offset=offset).reshape(shape)
        return t.to(device)


# ---------------------------------------------------------------------------------------
# Dequantization (dsv4-checkpoint.md section 2), on the device that holds the bytes. The
# code tables are make_fixtures.py's.

_LUTS = {}


def luts(device):
    if device not in _LUTS:
        fp8 = torch.cat([mf.E4M3, torch.tensor([float("nan")], dtype=torch.float64)])  # codes 0..127
        fp4 = mf.E2M1                                                                    # codes 0..7
        _LUTS[device] = (torch.cat([fp8, -fp8]).float().to(device), torch.cat([fp4, -fp4]).float().to(device))
    return _LUTS[device]


def ue8m0(b):
    """Scale bytes -> float32 2^(b - 127), exactly: the byte is the float's exponent field."""
    v = (b.to(torch.int32) << 23).view(torch.float32)
    return torch.where(b == 0, torch.full_like(v, 2.0 ** -127), v)  # exponent field 0 is subnormal


def dequant_fp8_block(codes, scale, block):
    """F8_E4M3 [out, in] with F8_E8M0 scales per block[0] x block[1] block -> float32."""
    out_f, in_f = codes.shape
    rows, cols = -(-out_f // block[0]), -(-in_f // block[1])
    if list(scale.shape) != [rows, cols]:
        raise ValueError(f"FP8 scale shape {list(scale.shape)}, expected {[rows, cols]}")
    s = ue8m0(scale).repeat_interleave(block[0], 0)[:out_f].repeat_interleave(block[1], 1)[:, :in_f]
    return luts(codes.device)[0][codes.long()] * s


def dequant_mxfp4(packed, scale):
    """MXFP4 I8 [out, in/2] (low nibble = even input) with F8_E8M0 scales [out, in/32] -> float32."""
    out_f, half = packed.shape
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(out_f, 2 * half)
    if scale.shape[0] != out_f or (2 * half) % scale.shape[1]:
        raise ValueError(f"MXFP4 scale shape {list(scale.shape)} does not fit weight [{out_f}, {2 * half}]")
    s = ue8m0(scale).repeat_interleave(2 * half // scale.shape[1], 1)
    return luts(packed.device)[1][codes.long()] * s


def check_tables(device):
    """The FP8 table and the scale decoding against torch's float8 casts, all 256 codes
    (where torch has them). Returns the number of mismatches, or None if not checked."""
    if not (hasattr(torch, "float8_e4m3fn") and hasattr(torch, "float8_e8m0fnu")):
        return None
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    ours = luts(device)[0][codes.long()]
    ref = codes.view(torch.float8_e4m3fn).float()
    bad = int(((ours != ref) & ~(ours.isnan() & ref.isnan())).sum())
    b = codes[:255]  # 255 is NaN
    bad += int((ue8m0(b) != b.view(torch.float8_e8m0fnu).float()).sum())
    return bad


# ---------------------------------------------------------------------------------------
# config.json (official keys) -> make_fixtures.py's fixture notation, for its
# transformers config and tensor list.


def fixture_from_config(c):
    n = c["num_hidden_layers"]
    if c.get("num_key_value_heads", 1) != 1 or c.get("n_shared_experts", 1) != 1:
        raise SystemExit("only num_key_value_heads 1 and n_shared_experts 1 are supported")
    y = c.get("rope_scaling") or {}
    if y.get("type", y.get("rope_type")) != "yarn":
        raise SystemExit("config.json: rope_scaling must be yarn")
    ratios = list(c["compress_ratios"][:n])
    return dict(
        V=c["vocab_size"], D=c["hidden_size"], ratios=ratios,
        csa=c.get("compress_rate_csa", 4), hca=c.get("compress_rate_hca", 128),
        hash_layers=c.get("num_hash_layers", 0), mtp=0,  # MTP layers are not built
        H=c["num_attention_heads"], hd=c["head_dim"], rd=c["qk_rope_head_dim"], q=c["q_lora_rank"],
        G=c["o_groups"], r=c["o_lora_rank"], sw=c["sliding_window"],
        nI=c["index_n_heads"], dI=c["index_head_dim"], topk=c["index_topk"],
        hc=c["hc_mult"], hc_iters=c["hc_sinkhorn_iters"], hc_eps=c["hc_eps"],
        E=c["n_routed_experts"], k=c["num_experts_per_tok"], I=c["moe_intermediate_size"],
        scoring=c["scoring_func"], routed_scale=c["routed_scaling_factor"], swiglu_limit=c["swiglu_limit"],
        rms_eps=c["rms_norm_eps"], rope_theta=c["rope_theta"], compress_rope_theta=c["compress_rope_theta"],
        yarn=dict(factor=float(y["factor"]), original_max_position_embeddings=y["original_max_position_embeddings"],
                  beta_fast=float(y["beta_fast"]), beta_slow=float(y["beta_slow"])),
        max_pos=c["max_position_embeddings"],
    )


# ---------------------------------------------------------------------------------------
# Loading official tensors into transformers parameters.


def load_weights(ckpt, targets, fx, block, device):
    """Copies every trunk tensor of `ckpt` (official names) into `targets` (transformers
    state-dict name -> tensor, written in place), dequantizing FP8/MXFP4 on `device`.
    Returns (tensors read, MTP tensors skipped); raises if anything is left unmatched."""
    I, E = fx["I"], fx["E"]
    done, experts, skipped, read = set(), {}, 0, 0
    names = set(ckpt.names())
    for name in ckpt.names():
        if name.startswith("mtp."):
            skipped += 1
            continue
        if name.endswith(".scale") and name[:-len("scale")] + "weight" in names:
            continue  # read with its weight
        dtype = ckpt.dtype(name)
        t = ckpt.get(name, device)
        if dtype == "F8_E4M3":
            t = dequant_fp8_block(t, ckpt.get(name[:-len("weight")] + "scale", device), block)
        elif dtype == "I8":
            t = dequant_mxfp4(t, ckpt.get(name[:-len("weight")] + "scale", device))
        read += 1
        if name in mf.TOP_LEVEL:
            key, dst = mf.TOP_LEVEL[name], None
        else:
            _, layer, rest = name.split(".", 2)
            if rest.startswith("ffn.experts."):
                _, _, e, w, _ = rest.split(".")
                e = int(e)
                if w == "w2":
                    key = f"model.layers.{layer}.mlp.experts.down_proj"
                    dst = targets[key][e]
                else:
                    key = f"model.layers.{layer}.mlp.experts.gate_up_proj"
                    dst = targets[key][e, :I] if w == "w1" else targets[key][e, I:]
                experts.setdefault(key, {}).setdefault(w, set()).add(e)
            elif rest in mf.IN_LAYER:
                key, dst = f"model.layers.{layer}.{mf.IN_LAYER[rest]}", None
            else:
                raise SystemExit(f"{name}: no transformers name for this tensor")
        if dst is None:
            if key not in targets:
                raise SystemExit(f"{name} -> {key}: transformers has no such parameter")
            dst = targets[key]
            done.add(key)
        if list(dst.shape) != list(t.shape):
            raise SystemExit(f"{name} -> {key}: checkpoint shape {list(t.shape)}, transformers {list(dst.shape)}")
        dst.copy_(t)
        del t
    # A fused expert tensor is complete when every expert's parts were written.
    for key, parts in experts.items():
        if all(len(parts.get(w, ())) == E for w in (("w2",) if key.endswith("down_proj") else ("w1", "w3"))):
            done.add(key)
    missing = sorted(set(targets) - done)
    if missing:
        raise SystemExit(f"{len(missing)} transformers tensors not in the checkpoint, e.g. {missing[:6]}")
    return read, skipped


def keep_in_fp32(model):
    """What from_pretrained(dtype=bfloat16) does: the modules transformers lists in
    _keep_in_fp32_modules_strict stay float32. Returns the names converted."""
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    if not keep:
        return []
    pattern = re.compile("|".join(rf"((^|\.){re.escape(m)}($|\.))" for m in keep))
    names = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
             if t is not None and t.is_floating_point() and t.dtype != torch.float32 and pattern.search(n)]
    cast_tensors(model, names, torch.float32)
    return names


def cast_tensors(model, names, dtype):
    """Casts the named parameters and floating buffers of `model` to `dtype`."""
    names = set(names)
    for mname, module in model.named_modules():
        for pname, p in list(module.named_parameters(recurse=False)):
            if (f"{mname}.{pname}" if mname else pname) in names:
                p.data = p.data.to(dtype)
        for bname, b in list(module.named_buffers(recurse=False)):
            if (f"{mname}.{bname}" if mname else bname) in names:
                module._buffers[bname] = b.to(dtype)


def set_experts(model, impl):
    """Selects transformers' routed-experts implementation; returns the one now in use."""
    if impl == "eager":
        return mf.use_eager_experts(model, log)
    model.set_experts_implementation(impl)
    return mf.experts_implementations(model)


# ---------------------------------------------------------------------------------------
# Timing


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy(out):
    return out.logits[:, -1].argmax(dim=-1, keepdim=True)


def time_single(model, prompt, steps, runs, device):
    """Best prefill and decode seconds over `runs` (each with a fresh cache)."""
    prefill, decode, tokens = [], [], None
    for _ in range(runs):
        sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        nxt = greedy(out)
        sync(device)
        t1 = time.perf_counter()
        cache, ids = out.past_key_values, [nxt]
        for _ in range(steps):
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache, nxt = out.past_key_values, greedy(out)
            ids.append(nxt)
        sync(device)
        t2 = time.perf_counter()
        prefill.append(t1 - t0)
        decode.append(t2 - t1)
        finite = bool(torch.isfinite(out.logits).all())
        tokens = torch.cat(ids, dim=1)[0].tolist()
        del out, cache
    return prefill, decode, tokens, finite


def time_batched(model, prompts, steps, runs, device):
    """Best seconds per decode step of len(prompts) sequences decoded together."""
    prefill, step = [], []
    for _ in range(runs):
        sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=prompts, use_cache=True, logits_to_keep=1)
        cache, nxt = out.past_key_values, greedy(out)
        sync(device)
        t1 = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache, nxt = out.past_key_values, greedy(out)
        sync(device)
        t2 = time.perf_counter()
        prefill.append(t1 - t0)
        step.append((t2 - t1) / steps)
        del out, cache
    return prefill, step


def bench(model, args, fx, device):
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, fx["V"], (1, args.prompt), generator=g).to(device)
    prefill, decode, tokens, finite = time_single(model, prompt, args.decode, args.runs, device)
    r = {
        "prefill_tok_s": round(args.prompt / min(prefill), 2),
        "prefill_ms": round(1e3 * min(prefill), 3),
        "decode_ms_per_token": round(1e3 * min(decode) / args.decode, 3),
        "decode_tok_s": round(args.decode / min(decode), 2),
        "prefill_s_runs": [round(s, 4) for s in prefill],
        "decode_s_runs": [round(s, 4) for s in decode],
        "greedy_tokens": tokens,
        "logits_finite": finite,
        "batched": {},
    }
    log(f"  prefill {r['prefill_tok_s']} tok/s, decode {r['decode_ms_per_token']} ms/token")
    for b in args.batch:
        prompts = torch.randint(0, fx["V"], (b, args.batch_prompt), generator=g).to(device)
        try:
            pre, step = time_batched(model, prompts, args.decode, args.runs, device)
            r["batched"][str(b)] = {"tok_s": round(b / min(step), 2), "step_ms": round(1e3 * min(step), 3),
                                    "prefill_ms": round(1e3 * min(pre), 3), "prompt_tokens": args.batch_prompt,
                                    "steps": args.decode}
            log(f"  batch {b}: {r['batched'][str(b)]['tok_s']} tok/s ({r['batched'][str(b)]['step_ms']} ms/step)")
        except Exception as e:  # reported as not working, not replaced by another measure
            r["batched"][str(b)] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            log(f"  batch {b}: failed: {type(e).__name__}: {e}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return r


# ---------------------------------------------------------------------------------------


def main():
    args = parse_args()
    import_torch()
    t_start = time.perf_counter()
    transformers, Config, Model = mf.import_transformers()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.set_grad_enabled(False)

    with open(os.path.join(args.model, "config.json")) as f:
        official = json.load(f)
    fx = fixture_from_config(official)
    n_mtp = official.get("num_nextn_predict_layers", 0)
    block = (official.get("quantization_config") or {}).get("weight_block_size", [128, 128])
    cfg = mf.transformers_config(fx, Config)
    cfg._attn_implementation = "eager"
    log(f"transformers {transformers.__version__}, torch {torch.__version__}; {args.model}: "
        f"{len(fx['ratios'])} layers {cfg.layer_types}, {n_mtp} MTP layer(s) skipped")

    # Built in bf16 directly on the device (as from_pretrained(dtype=bfloat16) builds it),
    # then the float32 modules, then the checkpoint over transformers' initial values.
    t0 = time.perf_counter()
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = Model(cfg)
    finally:
        torch.set_default_dtype(default_dtype)
    model.eval()
    fp32 = keep_in_fp32(model)
    if model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr():
        raise SystemExit("lm_head is tied to embed_tokens")
    t1 = time.perf_counter()
    ckpt = Checkpoint(args.model)
    read, skipped = load_weights(ckpt, model.state_dict(), fx, block, device)
    sync(device)
    t2 = time.perf_counter()
    if model.config._attn_implementation != "eager" and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    mf.use_eager_experts(model, log)  # the probe below runs the plainest experts path

    # One short forward before anything is timed. If transformers' forward does not take
    # the float32 modules (an RMSNorm with a float32 weight returns float32, which a bf16
    # linear refuses), everything goes back to bf16 and the JSON says so.
    probe = torch.zeros(1, 4, dtype=torch.long, device=device)
    fp32_note = None
    try:
        model(input_ids=probe, use_cache=True, logits_to_keep=1)
    except RuntimeError as e:
        if not fp32:
            raise
        fp32_note = f"float32 modules refused by the forward ({str(e)[:200]}); all tensors cast to bf16"
        log(fp32_note)
        cast_tensors(model, fp32, torch.bfloat16)
        fp32 = []
        model(input_ids=probe, use_cache=True, logits_to_keep=1)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    log(f"built in {t1 - t0:.1f} s, loaded {read} tensors ({ckpt.bytes / 2**30:.2f} GiB stored) in {t2 - t1:.1f} s; "
        f"{param_bytes / 2**30:.2f} GiB of parameters, {len(fp32)} kept in float32")

    # Self-checks that cost nothing: the code tables against torch's float8 casts, and
    # transformers' RoPE frequencies against dsv4-forward.md 2.3.
    try:
        tables = check_tables(device)
    except Exception as e:
        tables = f"not checked: {type(e).__name__}: {str(e)[:200]}"
    try:
        main_f, comp_f, _ = mf.expected_inv_freq(fx)
        rot = model.model.rotary_emb
        inv_freq_diff = max(float((rot.main_inv_freq.float().cpu() - main_f).abs().max() / main_f.abs().max()),
                            float((rot.compress_inv_freq.float().cpu() - comp_f).abs().max() / comp_f.abs().max()))
    except Exception as e:
        inv_freq_diff = f"not checked: {type(e).__name__}: {str(e)[:200]}"

    result = {
        "what": "transformers DeepseekV4ForCausalLM, eager attention, bf16 (dequantized FP8/MXFP4 weights)",
        "model": os.path.abspath(args.model),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "layers": len(fx["ratios"]),
        "layer_types": list(cfg.layer_types),
        "mtp_layers_skipped": n_mtp,
        "attn_implementation": model.config._attn_implementation,
        "dtype": "bfloat16",
        "float32_tensors": len(fp32),
        "float32_note": fp32_note,
        "parameter_gib": round(param_bytes / 2**30, 3),
        "checkpoint_gib": round(ckpt.bytes / 2**30, 3),
        "tensors_read": read,
        "mtp_tensors_skipped": skipped,
        "build_s": round(t1 - t0, 2),
        "load_s": round(t2 - t1, 2),
        "dequant_table_mismatches": tables,
        "inv_freq_rel_diff_vs_spec": inv_freq_diff,
        "prompt_tokens": args.prompt,
        "decode_tokens": args.decode,
        "runs": args.runs,
        "batch_prompt_tokens": args.batch_prompt,
        "timing": "prefill: one forward over the prompt (fresh cache, logits_to_keep=1) + argmax; decode: "
                  "one forward + argmax per token through the cache; batched: tok/s = batch / step time; "
                  "best of runs, torch.cuda.synchronize around each timed span",
        "experts": {},
    }
    for impl in args.experts:
        try:
            used = set_experts(model, impl)
            log(f"experts implementation {impl} (in use: {used})")
            r = bench(model, args, fx, device)
            r["experts_implementation_in_use"] = used
        except Exception as e:
            r = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            log(f"experts {impl}: failed: {type(e).__name__}: {e}")
        result["experts"][impl] = r
    first = result["experts"][args.experts[0]]
    for k in ("prefill_tok_s", "decode_ms_per_token", "decode_tok_s"):
        result[k] = first.get(k)
    result["batched_tok_s"] = {b: v.get("tok_s", v.get("error")) for b, v in first.get("batched", {}).items()}
    if device.type == "cuda":
        result["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(result, indent=1))
    return 0 if all("error" not in v for v in result["experts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
