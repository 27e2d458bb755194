#!/usr/bin/env python3
"""What log-probabilities cost, measured through a running `pagoda up` (side by side, interleaved, one run).

Decode: greedy chat completions of a fixed length (`ignore_eos`), plain against `logprobs` with 0 and 20
alternatives; the plain request takes the runner's argmax path, the others bring every row back to the host.
Scoring: `echo` + `logprobs` on a prose prompt (every prompt position's logits, no cached prefix) against a plain
one-token completion of the same prompt made unique per run, so neither adopts a cached prefix.

Prints each mode's median over the repetitions and its ratio to the plain mode.

    scripts/bench-logprobs.py [--url http://127.0.0.1:8080] [--reps 5] [--tokens 128] [--prompt-words 700]
"""

import argparse
import json
import statistics
import time
import urllib.request
from pathlib import Path

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def post(url, path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.load(r)
    return out, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-words", type=int, default=700)
    ap.add_argument("--prose", default=str(Path(__file__).resolve().parent.parent / "data/prose/alice29.txt"))
    a = ap.parse_args()

    decode_modes = {
        "plain": {},
        "logprobs, top 0": {"logprobs": True},
        "logprobs, top 20": {"logprobs": True, "top_logprobs": 20},
    }
    decode = {m: [] for m in decode_modes}
    words = Path(a.prose).read_text(encoding="utf-8", errors="replace").split()
    score_modes = {"plain prefill": {}, "echo + logprobs 1": {"echo": True, "logprobs": 1},
                   "echo + logprobs 20": {"echo": True, "logprobs": 20}}
    score = {m: [] for m in score_modes}
    for rep in range(a.reps):
        for mode, extra in decode_modes.items():
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me story number {rep}."}],
                    "max_tokens": a.tokens, "temperature": 0, "ignore_eos": True, **extra}
            out, secs = post(a.url, "/v1/chat/completions", body)
            assert out["usage"]["completion_tokens"] == a.tokens, out["usage"]
            decode[mode].append(a.tokens / secs)
        start = rep * a.prompt_words % max(1, len(words) - a.prompt_words)
        text = " ".join(words[start:start + a.prompt_words])
        for mode, extra in score_modes.items():
            # A number no other run has: the prompt shares no cached block with an earlier one.
            prompt = f"{time.time_ns()} {text}"
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
            out, secs = post(a.url, "/v1/completions", body)
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, out["usage"]
            score[mode].append(out["usage"]["prompt_tokens"] / secs)

    def table(title, unit, runs, base):
        print(f"{title} ({a.reps} runs each, interleaved)")
        print(f"| mode | median {unit} | ratio to {base} |")
        print("|---|---:|---:|")
        b = statistics.median(runs[base])
        for mode, v in runs.items():
            m = statistics.median(v)
            print(f"| {mode} | {m:.1f} | {m / b:.3f} |")
        print()

    table(f"Decode, {a.tokens} tokens a request", "generated tokens/s", decode, "plain")
    table(f"Scoring a prompt of ~{a.prompt_words} words, one request at a time", "prompt tokens/s", score,
          "plain prefill")


if __name__ == "__main__":
    main()
