#!/usr/bin/env python3
"""Expected token ids from Hugging Face `tokenizers` (and `transformers`) for keel's
tokenizer tests, plus a one-thread encode-speed baseline.

For each tokenizer (the DeepSeek-V3 tokenizer.json and the synthetic ones under
tests/fixtures/tokenizer/synthetic/) and each corpus line, writes one JSON line with:
  ids            tokenizer.encode(text, add_special_tokens=False).ids
  ids_special    tokenizer.encode(text, add_special_tokens=True).ids
  ids_hf         DeepSeek only: transformers AutoTokenizer(text)["input_ids"] (its
                 add_special_tokens=True path, which applies tokenizer_config.json)
  decoded        tokenizer.decode(ids, skip_special_tokens=True)
  decoded_skip   tokenizer.decode(ids_special, skip_special_tokens=True)
(skip_special_tokens=True is the Python binding's default; decoding without skipping is
checked in the tests on lines that hold no special token.)
Corpus lines are {"text": str} or {"hex": bytes}; raw bytes are encoded as
bytes.decode("utf-8", "replace"), keel's rule for invalid UTF-8.

Decode cases: random id sequences (seeded), which split multi-byte characters between
tokens, with tokenizers' decode of each.

  python3 tools/make_tokenizer_fixture.py --out OUT            # fixtures
  python3 tools/make_tokenizer_fixture.py --bench-text FILE     # speed only
"""
import argparse
import json
import os
import random
import sys
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"

from tokenizers import Tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "tokenizer")
SYNTHETIC = ["a_normalize", "b_splits", "c_chars_fallback", "d_chars_unk"]


def corpus_texts(path):
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if "hex" in rec:
                out.append((rec, bytes.fromhex(rec["hex"]).decode("utf-8", "replace")))
            else:
                out.append((rec, rec["text"]))
    return out


def encode_cases(tok, hf, corpus):
    rows = []
    for rec, text in corpus:
        ids = tok.encode(text, add_special_tokens=False).ids
        ids_special = tok.encode(text, add_special_tokens=True).ids
        row = dict(rec)
        row["ids"] = ids
        row["ids_special"] = ids_special
        if hf is not None:
            row["ids_hf"] = hf(text)["input_ids"]
        row["decoded"] = tok.decode(ids, skip_special_tokens=True)
        row["decoded_skip"] = tok.decode(ids_special, skip_special_tokens=True)
        rows.append(row)
    return rows


def decode_cases(tok, seed, count):
    rng = random.Random(seed)
    size = tok.get_vocab_size(with_added_tokens=True)
    rows = []
    for k in range(count):
        n = rng.randint(1, 24)
        ids = [rng.randrange(size) for _ in range(n)]
        rows.append({"decode_ids": ids, "decoded": tok.decode(ids, skip_special_tokens=True),
                     "decoded_skip": tok.decode(ids, skip_special_tokens=True)})
    return rows


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def bench(tok, text, seconds=3.0):
    """Best-of-runs one-thread MB/s, whole text and line by line."""
    data = len(text.encode("utf-8"))
    lines = text.splitlines(keepends=True)
    res = {}
    for mode in ("whole", "lines"):
        best = 0.0
        end = time.perf_counter() + seconds
        runs = 0
        while time.perf_counter() < end or runs < 2:
            t0 = time.perf_counter()
            if mode == "whole":
                tok.encode(text, add_special_tokens=False)
            else:
                for line in lines:
                    tok.encode(line, add_special_tokens=False)
            dt = time.perf_counter() - t0
            best = max(best, data / dt / 1e6)
            runs += 1
        res[mode] = round(best, 2)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="folder for the fixture files")
    ap.add_argument("--bench-text", help="text file to time HF encode on")
    args = ap.parse_args()
    import tokenizers
    meta = {"tokenizers": tokenizers.__version__, "python": sys.version.split()[0]}
    ds_dir = os.path.join(FIX, "deepseek-v3")
    ds = Tokenizer.from_file(os.path.join(ds_dir, "tokenizer.json"))

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        corpus = corpus_texts(os.path.join(FIX, "corpus.jsonl"))
        hf = None
        try:
            import transformers
            from transformers import AutoTokenizer
            hf = AutoTokenizer.from_pretrained(ds_dir)
            meta["transformers"] = transformers.__version__
            meta["transformers_class"] = type(hf).__name__
        except Exception as e:  # the ids_hf column is then absent
            meta["transformers_error"] = repr(e)
        rows = encode_cases(ds, hf, corpus) + decode_cases(ds, 7, 200)
        write_jsonl(os.path.join(args.out, "expected_deepseek-v3.jsonl"), rows)
        for name in SYNTHETIC:
            tok = Tokenizer.from_file(os.path.join(FIX, "synthetic", name + ".json"))
            rows = encode_cases(tok, None, corpus) + decode_cases(tok, 11, 60)
            write_jsonl(os.path.join(args.out, "expected_" + name + ".jsonl"), rows)
        with open(os.path.join(args.out, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        print(json.dumps(meta))

    if args.bench_text:
        with open(args.bench_text, encoding="utf-8") as f:
            text = f.read()
        res = bench(ds, text)
        res.update(meta)
        res["bytes"] = len(text.encode("utf-8"))
        print("hf_tokenizers_encode_MBps " + json.dumps(res))


if __name__ == "__main__":
    main()
