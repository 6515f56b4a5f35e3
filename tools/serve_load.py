#!/usr/bin/env python3
"""The serving engine's throughput under concurrent load, its steps read one by one and
pipelined (`keel serve`, the default, against `--no-pipeline`), side by side on one machine.

    python3 tools/serve_load.py --keel build/keel --model DIR [--device cuda] \\
        [--clients 8,64] [--requests 2] [--max-tokens 64] [--rounds 2] [-- SERVE_ARGS]

For each round, each client count and each mode (waited, then pipelined), it starts
`keel serve --port 0` on the model, sends that many clients at once, each `--requests`
requests one after another (POST /v1/completions: greedy, ignore_eos, `--max-tokens`
tokens, a prompt of its own), stops the server and prints the completion tokens a second
over the whole load and the median time a request took. Greedy completions are the same
text in both modes: any difference is printed (the pipelined steps must not change a
token). A Flash checkpoint from `keel synth` has no tokenizer: --tokenizer-from DIR
copies one beside it first (the demo model's, models/keel-tiny-v4, whose ids fit
Flash's vocabulary).
"""
import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path


def start_server(keel, model, device, pipelined, extra):
    cmd = [keel, "serve", "--model", model, "--device", device, "--port", "0", "--quiet",
           "--max-running", "64"] + ([] if pipelined else ["--no-pipeline"]) + extra
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    name = None
    for line in server.stdout:  # "serving DIR as 'NAME'", then "listening on http://HOST:PORT"
        served = re.search(r"serving .* as '(.*)'", line)
        name = served.group(1) if served else name
        found = re.search(r"listening on (http://\S+)", line)
        if found:
            threading.Thread(target=lambda: [None for _ in server.stdout], daemon=True).start()
            return server, (found.group(1), name)
    raise SystemExit(f"serve_load: keel serve exited ({server.wait()}) before listening: {' '.join(cmd)}")


def complete(server, prompt, max_tokens):
    url, name = server
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        reply = json.load(response)
    return reply["choices"][0]["text"], reply["usage"]["completion_tokens"]


def load(url, clients, requests, max_tokens):
    """Every client's requests in turn, all clients at once: (tokens/s, median s a request, texts)."""
    texts, seconds, tokens = {}, [], [0]
    lock = threading.Lock()

    def client(c):
        for r in range(requests):
            prompt = f"Request {r} of client {c}: it was a fine morning, and Elizabeth"
            start = time.monotonic()
            text, count = complete(url, prompt, max_tokens)
            with lock:
                texts[(c, r)] = text
                seconds.append(time.monotonic() - start)
                tokens[0] += count

    complete(url, "warm up", 4)
    start = time.monotonic()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tokens[0] / (time.monotonic() - start), statistics.median(seconds), texts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keel", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--clients", default="8,64")
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokenizer-from")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.tokenizer_from and not (Path(args.model) / "tokenizer.json").exists():
        shutil.copy(Path(args.tokenizer_from) / "tokenizer.json", Path(args.model) / "tokenizer.json")

    figures = {}  # (clients, mode) -> [(tokens/s, median s)]
    texts = {}
    for _ in range(args.rounds):
        for clients in [int(c) for c in args.clients.split(",")]:
            for mode in ("waited", "pipelined"):
                server, url = start_server(args.keel, args.model, args.device, mode == "pipelined", extra)
                try:
                    rate, median, got = load(url, clients, args.requests, args.max_tokens)
                finally:
                    server.terminate()
                    server.wait()
                figures.setdefault((clients, mode), []).append((rate, median))
                texts.setdefault(clients, {})[mode] = got
                print(f"{clients} clients, {mode}: {rate:.1f} tok/s, median request {median:.2f} s", flush=True)
            if texts[clients]["waited"] != texts[clients]["pipelined"]:
                differ = [k for k in texts[clients]["waited"] if texts[clients]["waited"][k] != texts[clients]["pipelined"].get(k)]
                print(f"{clients} clients: the pipelined texts DIFFER for {len(differ)} requests, e.g. {differ[:3]}")
    print()
    for clients in sorted({c for c, _ in figures}):
        waited = [r for r, _ in figures[(clients, "waited")]]
        pipelined = [r for r, _ in figures[(clients, "pipelined")]]
        change = statistics.mean(pipelined) / statistics.mean(waited) - 1
        print(f"{clients} clients: waited {' / '.join(f'{r:.1f}' for r in waited)} tok/s, "
              f"pipelined {' / '.join(f'{r:.1f}' for r in pipelined)} tok/s ({change:+.1%})")


if __name__ == "__main__":
    sys.exit(main())
