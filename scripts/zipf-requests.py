#!/usr/bin/env python3
"""Compares two configurations of a `pagoda bench tiers --workload zipf --json` report request by request.

Usage: scripts/zipf-requests.py REPORT.json BASELINE CONFIG [CONTEXT]

Prints how many requests each side computed (more than half their prompt) where the other reused stored KV, with
the TTFT and quality those requests moved, and, with CONTEXT, every request on that context side by side (prompt
tokens served from device, host and disk, computed tokens, quality, TTFT ms).
"""
import collections
import json
import sys


def cold(r):
    return r["computed_tokens"] > r["prompt_tokens"] / 2


def main():
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    report = json.load(open(sys.argv[1]))
    results = {r["name"]: r["per_request"] for r in report["results"]}
    base, conf = results[sys.argv[2]], results[sys.argv[3]]
    freq = collections.Counter(r["context"] for r in base)
    print(f"{len(freq)} contexts requested, {sum(1 for n in freq.values() if n == 1)} of them once")
    for label, (a, b) in {"hit, hit": (False, False), "cold, hit": (True, False),
                          "hit, cold": (False, True), "cold, cold": (True, True)}.items():
        pairs = [(x, y) for x, y in zip(base, conf) if cold(x) == a and cold(y) == b]
        dt = sum(y["ttft_ms"] - x["ttft_ms"] for x, y in pairs)
        dq = sum(y["quality"] - x["quality"] for x, y in pairs)
        print(f"{label:>10} (baseline, config): {len(pairs):3} requests, TTFT {dt:+9.0f} ms, quality {dq:+6.2f}")
    if len(sys.argv) == 5:
        ctx = int(sys.argv[4])
        print(f"context {ctx} ({freq[ctx]} requests): index, baseline [device, host, disk] computed quality ms | config")
        for i, (x, y) in enumerate(zip(base, conf)):
            if x["context"] == ctx:
                print(i, *(f"{r['hit_tokens']} {r['computed_tokens']} {r['quality']} {r['ttft_ms']:.0f}" for r in (x, y)),
                      sep=" | ")


if __name__ == "__main__":
    main()
