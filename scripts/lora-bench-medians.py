#!/usr/bin/env python3
"""Medians over runs of `pagoda bench engine --lora ...` (docs/BENCHMARKS.md, "LoRA adapters").

Usage: scripts/lora-bench-medians.py docs/bench-lora-run1.json docs/bench-lora-run2.json docs/bench-lora-run3.json

Prints, for every LoRA variant and phase, each run's tokens/s as a ratio to the base model measured in the same run
(right before it, on the same prompts), their median, and the median extra milliseconds per decode step.
"""
import json
import statistics as st
import sys

runs = [json.load(open(p)) for p in sys.argv[1:]]
if not runs or not runs[0].get("lora"):
    sys.exit("give the JSON reports of `pagoda bench engine --lora NAME=DIR ...` runs")
print("base prefill tokens/s", [round(r["prefill"]["tokens_per_s"]) for r in runs])
for k, d in enumerate(runs[0]["decode"]):
    print(f"base decode c={d['concurrency']} tokens/s", [round(r["decode"][k]["tokens_per_s"]) for r in runs])
for v, variant in enumerate(runs[0]["lora"]):
    name = variant["variant"]
    rp = [r["lora"][v]["prefill"]["tokens_per_s"] / r["prefill"]["tokens_per_s"] for r in runs]
    print(f"{name} | prefill | x base {[round(x, 2) for x in rp]} median {st.median(rp):.2f}")
    for k, d in enumerate(runs[0]["decode"]):
        rd = [r["lora"][v]["decode"][k]["tokens_per_s"] / r["decode"][k]["tokens_per_s"] for r in runs]
        ms = [r["lora"][v]["decode"][k]["ms_per_step"] - r["decode"][k]["ms_per_step"] for r in runs]
        print(f"{name} | decode c={d['concurrency']} | x base {[round(x, 2) for x in rd]} median {st.median(rd):.2f}"
              f" | extra ms/step {st.median(ms):.2f}")
