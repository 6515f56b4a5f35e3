#!/usr/bin/env python3
"""Trains keel-tiny-v4: a DeepSeek-V4-shaped model of 16.3 M parameters, with one MTP
layer, on the corpus of tools/build_corpus.py; exports it in the official DeepSeek-V4
format (FP8 128x128 ue8m0 dense linears, MXFP4 experts, bf16/f32 elsewhere, `mtp.0.*`)
and as an unquantized bf16 checkpoint; measures both. Runs on the GPU machine.

    python3 tools/train_tiny.py --corpus build-data/corpus --out OUT [--tokenizer DIR]
        [--train-seconds 450] [--smoke]

Steps (all in one run, every number goes to OUT/train_log.jsonl and OUT/summary.json):
1. Tokenizer (unless --tokenizer gives one): byte-level BPE trained with HF `tokenizers` on
   the training split (at most 2.5 MB per source), with DeepSeek's normalizer,
   pre-tokenizer, post-processor and decoder copied from the DeepSeek-V3 tokenizer.json in
   tests/fixtures/tokenizer/, and DeepSeek-V4's special tokens as added tokens.
2. Training: transformers' DeepseekV4ForCausalLM for the trunk (built from the
   transformers config that tools/make_fixtures.py builds), an MTP layer built as
   dsv4-checkpoint.md section 3 describes (e_proj, h_proj, enorm, hnorm, a transformers
   DeepseekV4DecoderLayer with sliding attention and a learned router, its own hc_head and
   norm; embedding and head shared), loss = CE(next token) + 0.3 CE(next-next token).
   fp32 master weights, bf16 autocast, AdamW, warm-up then cosine over wall-clock time,
   aux-loss-free router balancing (the learned routers' bias follows the expert load).
3. Export to OUT/model (quantized) and OUT/model-bf16, written with make_fixtures.py's
   safetensors writer and quantizers.
4. Evaluation in float32 (TF32 off) of each export read back into a fresh transformers
   model: perplexity of the validation split, and of OUT/model/valid_sample.txt scored
   exactly as `keel perplexity` scores it (BOS once, consecutive windows of 512 tokens,
   each a fresh sequence); MTP next-next-token top-1 accuracy; a reference-logits fixture
   for keel's tests; a greedy sample.
"""

import argparse
import json
import lzma
import math
import os
import random
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402  (safetensors writer, quantizers, official names)

T0 = time.time()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---------------------------------------------------------------------------------------
# The model, in make_fixtures.py's fixture notation (official compress_ratios of the trunk:
# 0 sliding, 4 CSA, 16 HCA; the MTP layer is sliding).

MODEL = dict(
    name="keel-tiny-v4",
    about="keel's trained demo model",
    seed=7, V=4096, D=256, ratios=[0, 0, 4, 16, 4, 16], csa=4, hca=16, hash_layers=2, mtp=1,
    H=4, hd=64, rd=16, q=128, G=2, r=64, sw=64, nI=16, dI=32, topk=16,
    hc=4, hc_iters=20, hc_eps=1e-6, E=8, k=2, I=256,
    scoring="sqrtsoftplus", routed_scale=1.5, swiglu_limit=10.0, rms_eps=1e-6,
    rope_theta=10000.0, compress_rope_theta=160000.0,
    yarn=dict(factor=4.0, original_max_position_embeddings=1024, beta_fast=32.0, beta_slow=1.0),
    max_pos=4096, quantized=True,
)

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
V4_TOKENS = ["<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>", "<think>", "</think>", "｜DSML｜",
             "<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>", "<｜title｜>", "<｜read_url｜>"]

MTP_WEIGHT = 0.3
CONTEXT = 512          # training sequence length and evaluation window (keel perplexity's default)


def log_line(out, obj):
    obj = {"t": round(time.time() - T0, 2), **obj}
    print(json.dumps(obj), flush=True)
    with open(os.path.join(out, "train_log.jsonl"), "a") as f:
        f.write(json.dumps(obj) + "\n")


def read_docs(path, limit=None):
    docs = []
    with lzma.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            docs.append(json.loads(line))
            if limit and len(docs) >= limit:
                break
    return docs


# ---------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(docs, out_dir):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    ref = json.load(open(os.path.join(REPO, "tests/fixtures/tokenizer/deepseek-v3/tokenizer.json"), encoding="utf-8"))
    split_patterns = [p["pattern"]["Regex"] for p in ref["pre_tokenizer"]["pretokenizers"] if p["type"] == "Split"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), "isolated") for p in split_patterns]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    per_source, texts = {}, []
    for d in docs:  # at most 2.5 MB of each source
        n = per_source.get(d["source"], 0)
        if n < 2_500_000:
            texts.append(d["text"])
            per_source[d["source"]] = n + len(d["text"])
    trainer = trainers.BpeTrainer(vocab_size=MODEL["V"] - len(V4_TOKENS), special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    tok.add_tokens([AddedToken(t, special=False, normalized=True) for t in V4_TOKENS])
    j = json.loads(tok.to_str())
    for key in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        j[key] = ref[key]  # exactly DeepSeek's pipeline around the BPE model
    j["model"]["byte_fallback"] = False
    text = json.dumps(j, ensure_ascii=False, indent=None, separators=(",", ":"))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(text)
    cfg = {
        "add_bos_token": True, "add_eos_token": False,
        "bos_token": {"__type": "AddedToken", "content": BOS, "lstrip": False, "normalized": True, "rstrip": False,
                      "single_word": False},
        "eos_token": {"__type": "AddedToken", "content": EOS, "lstrip": False, "normalized": True, "rstrip": False,
                      "single_word": False},
        "pad_token": {"__type": "AddedToken", "content": PAD, "lstrip": False, "normalized": True, "rstrip": False,
                      "single_word": False},
        "clean_up_tokenization_spaces": False, "legacy": True, "model_max_length": MODEL["max_pos"],
        "unk_token": None, "tokenizer_class": "LlamaTokenizerFast",
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return {"trained_on_chars": sum(len(t) for t in texts), "per_source_chars": per_source}


def load_tokenizer(tok_dir):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    assert tok.get_vocab_size() == MODEL["V"], tok.get_vocab_size()
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1, (tok.token_to_id(BOS), tok.token_to_id(EOS))
    return tok


def encode_docs(tok, docs):
    """One array: [BOS] + ids + [EOS] per document."""
    encs = tok.encode_batch([d["text"] for d in docs], add_special_tokens=False)
    out = []
    for e in encs:
        out.append(0)
        out.extend(e.ids)
        out.append(1)
    return torch.tensor(out, dtype=torch.int32)


# ---------------------------------------------------------------------------------------
# Model


def import_hf():
    transformers, Config, Model = mf.import_transformers()
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl
    return transformers, Config, Model, mdl


class MTP(nn.Module):
    """dsv4-checkpoint.md section 3: official names in comments."""

    def __init__(self, fx, Config, mdl):
        super().__init__()
        fx_mtp = dict(fx, ratios=fx["ratios"] + [0], mtp=0)
        cfg = mf.transformers_config(fx_mtp, Config)
        n = len(fx["ratios"])
        assert cfg.layer_types[n] == "sliding_attention" and cfg.mlp_layer_types[n] == "moe"
        D = fx["D"]
        self.e_proj = nn.Linear(D, D, bias=False)      # mtp.0.e_proj
        self.h_proj = nn.Linear(D, D, bias=False)      # mtp.0.h_proj
        self.enorm = mdl.DeepseekV4RMSNorm(D, eps=fx["rms_eps"])
        self.hnorm = mdl.DeepseekV4RMSNorm(D, eps=fx["rms_eps"])
        self.norm = mdl.DeepseekV4RMSNorm(D, eps=fx["rms_eps"])
        self.block = mdl.DeepseekV4DecoderLayer(cfg, n)  # mtp.0.{attn,ffn,hc_attn_*,...}
        self.hc_head = mdl.DeepseekV4HyperHead(cfg)      # mtp.0.hc_head_*

    def forward(self, streams, next_ids, embed, head, layer_kwargs):
        """streams: trunk streams before hc_head [B,S,hc,D]; next_ids: t_{i+1} [B,S]."""
        e = self.e_proj(self.enorm(embed(next_ids)))
        y = (self.h_proj(self.hnorm(streams)) + e.unsqueeze(2)).to(streams.dtype)
        kw = dict(layer_kwargs)
        kw["input_ids"] = next_ids
        y = self.block(y, **kw)
        return head(self.norm(self.hc_head(y)))


def init_module(m, std, mdl):
    """transformers' init for the modules of the MTP layer (it is no PreTrainedModel)."""
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.Linear):
                mod.weight.normal_(0, std)
            elif isinstance(mod, mdl.DeepseekV4RMSNorm):
                mod.weight.fill_(1.0)
            elif isinstance(mod, mdl.DeepseekV4HyperConnection):
                mod.fn.normal_(0, std)
                mod.base.zero_()
                mod.scale.fill_(1.0)
            elif isinstance(mod, mdl.DeepseekV4HyperHead):
                mod.hc_fn.normal_(0, std)
                mod.hc_base.zero_()
                mod.hc_scale.fill_(1.0)
            elif isinstance(mod, mdl.DeepseekV4Experts):
                mod.gate_up_proj.normal_(0, std)
                mod.down_proj.normal_(0, std)
            elif isinstance(mod, mdl.DeepseekV4TopKRouter):
                mod.weight.normal_(0, std)
                mod.e_score_correction_bias.zero_()
            elif isinstance(mod, mdl.DeepseekV4Attention):
                mod.sinks.zero_()


def set_experts(model, impl):
    if hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation(impl)
        except Exception:
            pass
    for m in model.modules():
        if type(m).__name__ == "DeepseekV4Experts":
            m.config._experts_implementation = impl


class Runner:
    """The trunk with hooks that expose what the MTP layer needs: the streams before
    hc_head and the keyword arguments every decoder layer gets."""

    def __init__(self, model, mtp):
        self.model, self.mtp, self.cap = model, mtp, {}
        model.model.hc_head.register_forward_pre_hook(self._streams)
        model.model.layers[-1].register_forward_pre_hook(self._kwargs, with_kwargs=True)

    def _streams(self, mod, args):
        self.cap["streams"] = args[0]

    def _kwargs(self, mod, args, kwargs):
        self.cap["kwargs"] = {k: v for k, v in kwargs.items()
                              if k in ("position_embeddings", "position_ids", "attention_mask", "past_key_values")}

    def __call__(self, ids, with_mtp=True):
        """ids [B, S(+1)]: logits of the trunk for ids[:, :S] and of the MTP layer for
        positions 0..S-2 given ids[:, 1:S]."""
        S = ids.shape[1]
        logits = self.model(input_ids=ids, use_cache=False).logits
        if not with_mtp:
            return logits, None
        streams = self.cap["streams"][:, :S - 1]
        kwargs = dict(self.cap["kwargs"])
        # Same positions 0..S-2; a sliding mask sliced to S-1 queries and keys.
        pe = kwargs["position_embeddings"]
        kwargs["position_embeddings"] = {k: (c[:, :S - 1], s[:, :S - 1]) for k, (c, s) in pe.items()}
        kwargs["position_ids"] = kwargs["position_ids"][:, :S - 1]
        if isinstance(kwargs.get("attention_mask"), torch.Tensor):
            kwargs["attention_mask"] = kwargs["attention_mask"][..., :S - 1, :S - 1]
        mtp_logits = self.mtp(streams, ids[:, 1:], self.model.model.embed_tokens, self.model.lm_head, kwargs)
        return logits, mtp_logits


def build(fx, Config, Model, mdl, device):
    cfg = mf.transformers_config(fx, Config)
    torch.manual_seed(fx["seed"])
    model = Model(cfg).to(torch.float32)
    g = torch.Generator().manual_seed(fx["seed"])
    with torch.no_grad():
        for L, layer in enumerate(model.model.layers):
            if cfg.mlp_layer_types[L] == "hash_moe":
                tid = torch.argsort(torch.rand(fx["V"], fx["E"], generator=g), dim=1)[:, :fx["k"]]
                layer.mlp.gate.tid2eid.copy_(tid)
    mtp = MTP(fx, Config, mdl)
    init_module(mtp, cfg.initializer_range, mdl)
    return cfg, model.to(device), mtp.to(device)


# ---------------------------------------------------------------------------------------
# Export: trained modules -> official tensors


def inverse_names():
    top = {v: k for k, v in mf.TOP_LEVEL.items()}
    inner = {v: k for k, v in mf.IN_LAYER.items()}
    return top, inner


def official_values(model, mtp, fx):
    """official name -> float32 CPU tensor (tid2eid int64)."""
    top, inner = inverse_names()
    out = {}

    def block(prefix, sd):
        for k, v in sd.items():
            v = v.detach().float().cpu() if v.is_floating_point() else v.detach().cpu().to(torch.int64)
            if k == "mlp.experts.gate_up_proj":
                I = fx["I"]
                for e in range(fx["E"]):
                    out[f"{prefix}ffn.experts.{e}.w1.weight"] = v[e, :I].contiguous()
                    out[f"{prefix}ffn.experts.{e}.w3.weight"] = v[e, I:].contiguous()
            elif k == "mlp.experts.down_proj":
                for e in range(fx["E"]):
                    out[f"{prefix}ffn.experts.{e}.w2.weight"] = v[e].contiguous()
            else:
                out[prefix + inner[k]] = v

    sd = model.state_dict()
    for k, v in sd.items():
        if k in top:
            out[top[k]] = v.detach().float().cpu()
    for L in range(len(fx["ratios"])):
        p = f"model.layers.{L}."
        block(f"layers.{L}.", {k[len(p):]: v for k, v in sd.items() if k.startswith(p)})
    m = "mtp.0."
    msd = mtp.state_dict()
    block(m, {k[len("block."):]: v for k, v in msd.items() if k.startswith("block.")})
    for n in ("e_proj", "h_proj", "enorm", "hnorm", "norm"):
        out[f"{m}{n}.weight"] = msd[f"{n}.weight"].detach().float().cpu()
    for n in ("fn", "base", "scale"):
        out[f"{m}hc_head_{n}"] = msd[f"hc_head.hc_{n}"].detach().float().cpu()
    return out


def export(values, fx, directory, quantized, shard_bytes=None):
    """Writes config.json + safetensors; returns the values the checkpoint represents
    (bf16-rounded or dequantized, as float32) and the byte count."""
    os.makedirs(directory, exist_ok=True)
    specs = mf.official_specs(fx)
    names = [n for n, _, _ in specs]
    missing = sorted(set(names) - set(values))
    extra = sorted(set(values) - set(names))
    assert not missing and not extra, (missing[:5], extra[:5])
    files, represented = {}, {}
    for name, shape, role in specs:
        t = values[name]
        assert list(t.shape) == shape, (name, t.shape, shape)
        if role == "table":
            files[name] = mf.stored(t.to(torch.int64))
            represented[name] = t
        elif quantized and role == "dense":
            codes, scales, deq = mf.quantize_fp8_block(t)
            files[name] = mf.Stored("F8_E4M3", codes.shape, mf.raw_bytes(codes))
            files[name[:-len("weight")] + "scale"] = mf.Stored("F8_E8M0", scales.shape, mf.raw_bytes(scales))
            represented[name] = deq
        elif quantized and role == "expert":
            packed, scales, deq = mf.quantize_mxfp4(t)
            files[name] = mf.Stored("I8", packed.shape, mf.raw_bytes(packed))
            files[name[:-len("weight")] + "scale"] = mf.Stored("F8_E8M0", scales.shape, mf.raw_bytes(scales))
            represented[name] = deq
        elif name.endswith(".weight"):  # embed, head, norms, router, compressors, weights_proj (and bf16 linears)
            b = t.to(torch.bfloat16)
            files[name] = mf.Stored("BF16", b.shape, mf.raw_bytes(b))
            represented[name] = b.float()
        else:  # hc_*, attn_sink, ape, gate.bias: f32 as in the real checkpoint
            files[name] = mf.stored(t.float())
            represented[name] = t.float()
    config = mf.official_config(dict(fx, quantized=quantized))
    config["torch_dtype"] = "bfloat16"
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    total = sum(len(s.data) for s in files.values())
    if not shard_bytes or total <= shard_bytes:
        mf.write_safetensors(os.path.join(directory, "model.safetensors"), files, {"format": "pt"})
        mf.write_index(directory, list(files), total)
    else:
        shards, cur, size = [], {}, 0
        for n, s in files.items():
            if cur and size + len(s.data) > shard_bytes:
                shards.append(cur)
                cur, size = {}, 0
            cur[n] = s
            size += len(s.data)
        shards.append(cur)
        wmap = {}
        for i, sh in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            mf.write_safetensors(os.path.join(directory, fname), sh, {"format": "pt"})
            wmap.update({n: fname for n in sh})
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, separators=(",", ":"))
            f.write("\n")
    return represented, total


def load_into(values, fx, Config, Model, mdl, device):
    """A fresh float32 transformers model + MTP layer holding `values` (official names)."""
    cfg, model, mtp = build(fx, Config, Model, mdl, "cpu")
    sd = mf.transformers_state(values, fx)
    own = model.state_dict()
    assert set(own) == set(sd), (sorted(set(own) ^ set(sd)))[:6]
    model.load_state_dict(sd)
    m = {}
    mvals = {k[len("mtp.0."):]: v for k, v in values.items() if k.startswith("mtp.0.")}
    fake = {f"layers.0.{k}": v for k, v in mvals.items()
            if not k.split(".")[0] in ("e_proj", "h_proj", "enorm", "hnorm", "norm")
            and not k.startswith("hc_head_")}
    one = dict(fx, ratios=[0], hash_layers=0)
    block_sd = mf.transformers_state(fake, one)
    for k, v in block_sd.items():
        m["block." + k[len("model.layers.0."):]] = v
    for n in ("e_proj", "h_proj", "enorm", "hnorm", "norm"):
        m[f"{n}.weight"] = mvals[f"{n}.weight"]
    for n in ("fn", "base", "scale"):
        m[f"hc_head.hc_{n}"] = mvals[f"hc_head_{n}"]
    own_m = mtp.state_dict()
    assert set(own_m) == set(m), sorted(set(own_m) ^ set(m))[:6]
    mtp.load_state_dict(m)
    set_experts(model, "eager")
    set_experts(mtp, "eager")
    return model.to(device).eval(), mtp.to(device).eval()


# ---------------------------------------------------------------------------------------
# Evaluation (float32, TF32 off)


@torch.no_grad()
def score_windows(runner, ids, context, device, batch=32, mtp=True):
    """keel perplexity's scoring: consecutive windows of `context` tokens of `ids`, each a
    fresh sequence; returns nll sum, tokens predicted, and MTP / next-token hits."""
    starts = list(range(0, len(ids) - 1, context))
    windows = [ids[s:s + context] for s in starts]
    r = dict(nll=0.0, n=0, top1=0, mtp_hits=0, mtp_n=0, windows=len(windows))
    groups = {}
    for w in windows:
        groups.setdefault(len(w), []).append(w)
    for length, ws in groups.items():
        for i in range(0, len(ws), batch):
            x = torch.stack([torch.as_tensor(w, dtype=torch.long) for w in ws[i:i + batch]]).to(device)
            logits, mlog = runner(x, with_mtp=mtp and length >= 3)
            lp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
            tgt = x[:, 1:]
            r["nll"] -= float(lp.gather(-1, tgt.unsqueeze(-1)).sum())
            r["n"] += tgt.numel()
            r["top1"] += int((logits[:, :-1].argmax(-1) == tgt).sum())
            if mlog is not None:
                # MTP row i (i = 0..S-2) predicts token i+2.
                pred = mlog[:, :-1].argmax(-1)
                r["mtp_hits"] += int((pred == x[:, 2:]).sum())
                r["mtp_n"] += x[:, 2:].numel()
    r["ppl"] = math.exp(r["nll"] / r["n"])
    r["nats_per_token"] = r["nll"] / r["n"]
    r["top1_acc"] = r["top1"] / r["n"]
    if r["mtp_n"]:
        r["mtp_top1_acc"] = r["mtp_hits"] / r["mtp_n"]
    return r


@torch.no_grad()
def greedy(model, tok, prompt, n, device):
    ids = [0] + tok.encode(prompt, add_special_tokens=False).ids
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0, -1]
        nxt = int(logits.argmax())
        ids.append(nxt)
        if nxt == 1:
            break
    return tok.decode(ids[1:], skip_special_tokens=False), ids


# ---------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="build-data/corpus")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", help="directory with tokenizer.json (skip tokenizer training)")
    ap.add_argument("--train-seconds", type=float, default=450.0, help="training stops this long after start")
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--experts", default="auto", help="experts backend for training: auto, eager, grouped_mm")
    ap.add_argument("--smoke", action="store_true", help="small data, few steps, both experts backends timed")
    args = ap.parse_args()
    out = args.out
    os.makedirs(out, exist_ok=True)
    device = "cuda"
    transformers, Config, Model, mdl = import_hf()
    fx = dict(MODEL)
    summary = {"torch": torch.__version__, "transformers": transformers.__version__,
               "gpu": torch.cuda.get_device_name(0), "model": {k: v for k, v in fx.items()}}
    log_line(out, {"event": "start", "torch": torch.__version__, "transformers": transformers.__version__})

    train_docs = read_docs(os.path.join(args.corpus, "train.jsonl.xz"))
    valid_docs = read_docs(os.path.join(args.corpus, "valid.jsonl.xz"))
    model_dir = os.path.join(out, "model")
    if args.tokenizer:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            os.makedirs(model_dir, exist_ok=True)
            with open(os.path.join(args.tokenizer, f), "rb") as src, open(os.path.join(model_dir, f), "wb") as dst:
                dst.write(src.read())
        summary["tokenizer"] = {"from": "given"}
    else:
        t = time.time()
        summary["tokenizer"] = train_tokenizer(train_docs, model_dir)
        summary["tokenizer"]["seconds"] = round(time.time() - t, 1)
        log_line(out, {"event": "tokenizer", **summary["tokenizer"]})
    tok = load_tokenizer(model_dir)

    if args.smoke:
        random.Random(0).shuffle(train_docs)
        train_docs = train_docs[:3000]
    t = time.time()
    train_ids = encode_docs(tok, train_docs)
    valid_ids = encode_docs(tok, valid_docs)
    chars = sum(len(d["text"]) for d in train_docs)
    summary["data"] = {"train_tokens": len(train_ids), "valid_tokens": len(valid_ids), "train_chars": chars,
                       "chars_per_token": round(chars / len(train_ids), 3), "encode_seconds": round(time.time() - t, 1)}
    log_line(out, {"event": "data", **summary["data"]})

    # Validation sample for keel perplexity: the start of the first validation document of
    # each source, 2,500 characters at most, cut at a line end.
    sample_parts, seen = [], set()
    for d in valid_docs:
        if d["source"] in seen:
            continue
        seen.add(d["source"])
        text = d["text"][:2500]
        if len(d["text"]) > 2500 and "\n" in text:
            text = text[:text.rindex("\n")]
        sample_parts.append(text)
    sample_text = "\n\n".join(sample_parts) + "\n"
    with open(os.path.join(model_dir, "valid_sample.txt"), "w", encoding="utf-8") as f:
        f.write(sample_text)
    sample_ids = [0] + tok.encode(sample_text, add_special_tokens=False).ids

    # ---- training
    cfg, model, mtp = build(fx, Config, Model, mdl, device)
    n_trunk = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    summary["parameters"] = {"trunk": n_trunk, "mtp": n_mtp, "total": n_trunk + n_mtp}
    log_line(out, {"event": "model", **summary["parameters"], "layer_types": cfg.layer_types,
                   "mlp_layer_types": cfg.mlp_layer_types})
    runner = Runner(model, mtp)
    params = [p for p in list(model.parameters()) + list(mtp.parameters()) if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    routers = [m for m in list(model.modules()) + list(mtp.modules()) if isinstance(m, mdl.DeepseekV4TopKRouter)]
    loads = {}

    def count_load(mod, inp, outp):
        loads[id(mod)] = torch.bincount(outp[2].reshape(-1), minlength=mod.num_experts)

    for r in routers:
        r.register_forward_hook(count_load)

    B, S = args.batch, CONTEXT
    gpu_ids = train_ids.to(device)
    gen = torch.Generator(device=device).manual_seed(1)

    def batch():
        starts = torch.randint(0, len(gpu_ids) - S - 2, (B,), device=device, generator=gen)
        idx = starts[:, None] + torch.arange(S + 1, device=device)[None]
        return gpu_ids[idx].long()

    val_batch = []
    g = torch.Generator().manual_seed(2)
    for _ in range(16):
        s = int(torch.randint(0, len(valid_ids) - S - 2, (1,), generator=g))
        val_batch.append(valid_ids[s:s + S + 1].long())
    val_batch = torch.stack(val_batch).to(device)

    def train_step(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, mlog = runner(x[:, :S + 1])
            # trunk: positions 0..S-1 predict 1..S; MTP row i predicts i+2, rows 0..S-2.
            lm = F.cross_entropy(logits[:, :S].float().reshape(-1, fx["V"]), x[:, 1:S + 1].reshape(-1))
            lt = F.cross_entropy(mlog[:, :S - 1].float().reshape(-1, fx["V"]), x[:, 2:S + 1].reshape(-1))
            loss = lm + MTP_WEIGHT * lt
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            for r in routers:
                c = loads.get(id(r))
                if c is not None:
                    r.e_score_correction_bias += 1e-3 * torch.sign(c.float().mean() - c.float())
        return lm, lt, gn

    @torch.no_grad()
    def val_loss():
        model.eval()
        mtp.eval()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, mlog = runner(val_batch)
            lm = F.cross_entropy(logits[:, :S].float().reshape(-1, fx["V"]), val_batch[:, 1:].reshape(-1))
            lt = F.cross_entropy(mlog[:, :S - 1].float().reshape(-1, fx["V"]), val_batch[:, 2:].reshape(-1))
        model.train()
        mtp.train()
        return float(lm), float(lt)

    torch.backends.cuda.matmul.allow_tf32 = True
    model.train()
    mtp.train()
    impls = ["grouped_mm", "eager"] if args.experts == "auto" else [args.experts]
    speeds = {}
    if args.smoke or args.experts == "auto":
        for impl in impls:  # a few timed steps of each backend
            try:
                set_experts(model, impl)
                set_experts(mtp, impl)
                train_step(batch())
                torch.cuda.synchronize()
                t = time.time()
                steps = 5
                for _ in range(steps):
                    train_step(batch())
                torch.cuda.synchronize()
                speeds[impl] = B * S * steps / (time.time() - t)
            except Exception as e:
                speeds[impl] = f"{type(e).__name__}: {str(e)[:300]}"
            log_line(out, {"event": "backend", "impl": impl, "tokens_per_s": speeds[impl]})
        ok = {k: v for k, v in speeds.items() if isinstance(v, float)}
        impl = max(ok, key=ok.get)
    else:
        impl = args.experts
    set_experts(model, impl)
    set_experts(mtp, impl)
    summary["training"] = {"experts_backend": impl, "backend_tokens_per_s": speeds, "batch": B, "seq": S,
                           "lr": args.lr, "mtp_weight": MTP_WEIGHT}

    csv = open(os.path.join(out, "loss_curve.csv"), "w")
    csv.write("step,seconds,tokens,lr,loss,loss_next,loss_mtp,grad_norm,val_loss_next,val_loss_mtp\n")
    t_start = time.time()
    deadline = T0 + args.train_seconds
    budget = deadline - t_start
    warmup = 150 if not args.smoke else 5
    step, tokens, last_val, ema = 0, 0, t_start, None
    while True:
        now = time.time()
        if now >= deadline or (args.smoke and step >= 30):
            break
        frac = (now - t_start) / max(budget, 1e-6)
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for gparam in opt.param_groups:
            gparam["lr"] = lr
        lm, lt, gn = train_step(batch())
        step += 1
        tokens += B * S
        if step % 25 == 0 or step == 1:
            lm, lt, gn = float(lm), float(lt), float(gn)
            vl = ("", "")
            if time.time() - last_val > 30 or step == 1:
                vl = val_loss()
                last_val = time.time()
            csv.write(f"{step},{time.time() - t_start:.1f},{tokens},{lr:.3e},{lm + MTP_WEIGHT * lt:.4f},{lm:.4f},"
                      f"{lt:.4f},{gn:.3f},{vl[0] if vl[0] == '' else round(vl[0], 4)},"
                      f"{vl[1] if vl[1] == '' else round(vl[1], 4)}\n")
            csv.flush()
            log_line(out, {"step": step, "tokens": tokens, "lr": lr, "loss_next": round(lm, 4),
                           "loss_mtp": round(lt, 4), "grad_norm": round(gn, 3),
                           "tok_per_s": round(tokens / (time.time() - t_start))})
    torch.cuda.synchronize()
    train_time = time.time() - t_start
    vl = val_loss()
    summary["training"].update({"steps": step, "tokens": tokens, "seconds": round(train_time, 1),
                                "tokens_per_s": round(tokens / train_time),
                                "epochs": round(tokens / len(train_ids), 3),
                                "final_train_loss_next": round(float(lm), 4), "final_train_loss_mtp": round(float(lt), 4),
                                "final_val_batch_loss_next_bf16_autocast": round(vl[0], 4),
                                "final_val_batch_loss_mtp_bf16_autocast": round(vl[1], 4)})
    csv.close()
    log_line(out, {"event": "trained", **summary["training"]})

    # ---- export
    values = official_values(model, mtp, fx)
    del model, mtp, runner, opt
    torch.cuda.empty_cache()
    t = time.time()
    deq, qbytes = export(values, fx, model_dir, quantized=True)
    bvals, bbytes = export(values, fx, os.path.join(out, "model-bf16"), quantized=False, shard_bytes=12_000_000)
    summary["export"] = {"quantized_bytes": qbytes, "bf16_bytes": bbytes, "seconds": round(time.time() - t, 1)}
    log_line(out, {"event": "exported", **summary["export"]})

    # ---- evaluation in float32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    valid_list = valid_ids.tolist()
    results = {}
    def evaluate(tag, vals):
        t = time.time()
        m, mt = load_into(vals, fx, Config, Model, mdl, device)
        r = Runner(m, mt)
        results[tag] = {"valid_split": score_windows(r, valid_list, CONTEXT, device),
                        "valid_sample": score_windows(r, sample_ids, CONTEXT, device, mtp=False),
                        "seconds": round(time.time() - t, 1)}
        log_line(out, {"event": "eval", "tag": tag, "valid_ppl": results[tag]["valid_split"]["ppl"],
                       "sample_ppl": results[tag]["valid_sample"]["ppl"],
                       "mtp_acc": results[tag]["valid_split"].get("mtp_top1_acc")})
        if tag != "fp8_mxfp4":
            return
        # Reference logits for keel's test: the first 96 tokens of the sample.
        ids = torch.tensor([sample_ids[:96]], device=device)
        with torch.no_grad():
            full = m(input_ids=ids, use_cache=False).logits[0].float().cpu()
        pos = list(range(3, 96, 8))
        ref = {"input_ids": mf.stored(ids.cpu().to(torch.int32)),
               "positions": mf.stored(torch.tensor(pos, dtype=torch.int32)),
               "logits": mf.stored(full[pos].contiguous()),
               "argmax": mf.stored(full.argmax(-1).to(torch.int32)),
               "max_logit": mf.stored(full.max(-1).values.contiguous())}
        mf.write_safetensors(os.path.join(out, "keel_tiny_v4_reference.safetensors"), ref, {
            "format": "pt", "generator": "tools/train_tiny.py",
            "about": "transformers DeepseekV4ForCausalLM (float32, eager experts, TF32 off, GPU) on the "
                     "dequantized models/keel-tiny-v4 weights; logits at `positions`, argmax and max logit "
                     "at every position",
            "torch": torch.__version__, "transformers": transformers.__version__})
        prompts = ["It is a truth universally acknowledged", "In the beginning", "The President said that",
                   "Call me Ishmael."]
        summary["samples"] = {p: greedy(m, tok, p, 60, device)[0] for p in prompts}
        log_line(out, {"event": "samples", **summary["samples"]})

    for tag, vals in (("bf16", bvals), ("fp8_mxfp4", deq)):
        try:
            evaluate(tag, vals)
        except Exception:
            import traceback
            log_line(out, {"event": "eval failed", "tag": tag, "error": traceback.format_exc()})
        torch.cuda.empty_cache()
    summary["eval"] = results
    summary["total_seconds"] = round(time.time() - T0, 1)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, ensure_ascii=False)
        f.write("\n")
    log_line(out, {"event": "done", "total_seconds": summary["total_seconds"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
