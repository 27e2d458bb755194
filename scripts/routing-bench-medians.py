#!/usr/bin/env python3
"""Medians over several `pagoda bench routing --json` reports of the same shape: per strategy, the median mean and
p99 TTFT, prefix hit rate, tokens/s and (multi-LoRA traces) adapter loads and evictions, with each strategy's
ratio to round robin taken within each run before the median.

    scripts/routing-bench-medians.py docs/bench-routing-lora-run1.json docs/bench-routing-lora-run2.json ...
"""

import json
import statistics
import sys


def main():
    runs = [json.load(open(p)) for p in sys.argv[1:]]
    if not runs:
        sys.exit(__doc__)
    strategies = [r["strategy"] for r in runs[0]["results"]]

    def values(strategy, key):
        out = []
        for run in runs:
            by = {r["strategy"]: r for r in run["results"]}
            out.append(by[strategy][key])
        return out

    def ratio(strategy, key, better_low=True):
        out = []
        for run in runs:
            by = {r["strategy"]: r for r in run["results"]}
            base, own = by["round_robin"][key], by[strategy][key]
            if own and base:
                out.append(base / own if better_low else own / base)
        return statistics.median(out) if out else float("nan")

    lora = runs[0]["options"].get("lora_adapters", 0) > 0
    print(f"{len(runs)} runs; medians (ratios to round robin within each run, then the median)")
    head = "| strategy | mean TTFT (s) | × round robin | p99 TTFT (s) | prefix hit rate | tokens/s | × round robin |"
    if lora:
        head += " adapter loads | evictions |"
    print(head)
    print("|---" + "|---:" * (head.count("|") - 2) + "|")
    for s in strategies:
        med = lambda k: statistics.median(values(s, k))
        row = (f"| {s} | {med('mean_ttft_s'):.3f} | {ratio(s, 'mean_ttft_s'):.2f} | {med('p99_ttft_s'):.2f} | "
               f"{100 * med('prefix_hit_rate'):.1f}% | {med('completion_tokens_per_s'):.1f} | "
               f"{ratio(s, 'completion_tokens_per_s', better_low=False):.2f} |")
        if lora:
            row += f" {med('lora_loads'):.0f} | {med('lora_evictions'):.0f} |"
        print(row)


if __name__ == "__main__":
    main()
