#!/usr/bin/env python3
"""What a LoRA adapter costs a client, measured through a real `pagoda up` (router, worker and engine).

Starts one server with `--lora NAME=DIR` and, round after round (the order alternating), runs `pagoda bench load`
in a closed loop against the base model and against the adapter (`--model-id`). Only one load runs at a time.
`bench load` checks every answer against the greedy reference of the model it asks, so the adapter's answers are
checked against the adapter's own. Per model it reports the medians over the rounds of the request latency (p50,
p99), TTFT p99 and generated tokens/s, and the adapter's ratio to the base model.

    scripts/bench-lora-load.py --lora a=/tmp/lora-r16-1 [--bin target/release/pagoda] [--reps 3]
        [--duration 30] [--concurrency 8] [--max-tokens 64] [--json out.json]
"""

import argparse
import json
import statistics
import sys
import urllib.request

from pagoda_servers import bench_load, start_up, wait_ready


def load(a, url, model):
    return bench_load(a.bin, url, ["--model-id", model, "--mode", "closed", "--concurrency", str(a.concurrency),
                                   "--duration-secs", str(a.duration), "--max-tokens", str(a.max_tokens),
                                   "--streaming", "all"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/pagoda")
    ap.add_argument("--lora", required=True, help="NAME=DIR, as `pagoda up --lora` takes it")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--duration", type=int, default=30)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=18590)
    ap.add_argument("--json")
    a = ap.parse_args()
    adapter = a.lora.split("=", 1)[0]
    url = f"http://127.0.0.1:{a.port}"
    proc = start_up(a.bin, a.port, ["--threads", "2", "--lora", a.lora], "bench-lora-load")
    try:
        wait_ready(url, proc)
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
            models = json.load(r)
        base = models["data"][0]["id"]
        runs = {base: [], adapter: []}
        for rep in range(a.reps):
            order = [base, adapter] if rep % 2 == 0 else [adapter, base]
            for model in order:
                s = load(a, url, model)
                runs[model].append(s)
                print(f"round {rep + 1} {model}: latency p50 {s['p50_latency_s']:.3f} s, "
                      f"{s['completion_tokens_per_s']:.1f} tok/s, mismatched {s['mismatched']}", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    keys = ["p50_latency_s", "p99_latency_s", "p99_ttft_s", "completion_tokens_per_s"]

    def med(model, key):
        return statistics.median(r[key] for r in runs[model])

    print(f"closed loop of {a.concurrency} streams, {a.max_tokens} tokens, {a.duration} s per run, {a.reps} rounds; "
          "medians over the rounds (ratio to the base model)")
    print("| model | latency p50 (s) | latency p99 (s) | TTFT p99 (s) | tokens/s | completed (all rounds) |")
    print("|---|---:|---:|---:|---:|---:|")
    for model in runs:
        cells = []
        for k in keys:
            v, b = med(model, k), med(base, k)
            cells.append(f"{v:.3f}" + (f" ({v / b:.2f}×)" if model != base and b else ""))
        done = sum(r["completed"] for r in runs[model])
        print(f"| {model} | {' | '.join(cells)} | {done} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
