#!/usr/bin/env python3
"""How far choosing which contexts to keep can take a fixed codec's capacity, from a stored `bench tiers` run.

Reads one configuration's per-request rows (default `lru+int8`) from a `pagoda bench tiers --workload zipf --json`
file and asks: had the tiers (host + disk, from the run's options) held, from its first request on, the set of
contexts that serves the most requests and fits at `--bytes-per-token`, how many requests would have been cold, and
what would the mean TTFT be at this run's own cold and warm costs? Arithmetic on a measured run, not a run: every
cold request is priced at the run's mean cold TTFT, every warm one at its mean warm TTFT, and a context's size is
its shortest prompt (question included, so slightly over). The default size is int8 on SmolLM2-135M: 30 layers x
3 kv-heads x 64 dims x (K, V) at 8.56 bits.

    python3 scripts/bench/evicpress_choice_bound.py docs/bench-tiers-zipf-capacity-bf16-2.json
"""
import argparse
import collections
import json


def best_set(counts, tokens, budget):
    """The contexts that serve the most requests within `budget` tokens (0/1 knapsack over tokens)."""
    best = {0: (0, frozenset())}
    for c, n in counts.items():
        for used, (served, chosen) in list(best.items()):
            t = used + tokens[c]
            if t <= budget and best.get(t, (-1,))[0] < served + n:
                best[t] = (served + n, chosen | {c})
    return max(best.values(), key=lambda v: v[0])[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--config", default="lru+int8")
    ap.add_argument("--bytes-per-token", type=float, default=30 * 3 * 64 * 2 * 8.56 / 8)
    a = ap.parse_args()
    run = json.load(open(a.json))
    rows = next(r for r in run["results"] if r["name"] == a.config)["per_request"]
    cold = [r["ttft_ms"] for r in rows if r["computed_tokens"] == r["prompt_tokens"] or not any(r["hit_tokens"])]
    warm = [r["ttft_ms"] for r in rows if not (r["computed_tokens"] == r["prompt_tokens"] or not any(r["hit_tokens"]))]
    n = len(rows)
    cold_ms, warm_ms = sum(cold) / len(cold), sum(warm) / len(warm)
    counts = collections.Counter(r["context"] for r in rows)
    tokens = {}
    for r in rows:
        tokens[r["context"]] = min(tokens.get(r["context"], r["prompt_tokens"]), r["prompt_tokens"])
    capacity = (run["options"]["host_mib"] + run["options"]["disk_mib"]) << 20
    hot = best_set(counts, tokens, int(capacity // a.bytes_per_token))
    hot_requests = sum(counts[c] for c in hot)
    best_cold = n - (hot_requests - len(hot))
    measured = sum(r["ttft_ms"] for r in rows) / n
    best = (best_cold * cold_ms + (n - best_cold) * warm_ms) / n
    print(f"{a.config}: {n} requests over {len(counts)} contexts, {len(cold)} cold (mean {cold_ms:.0f} ms), "
          f"{len(warm)} warm (mean {warm_ms:.0f} ms), mean TTFT {measured:.1f} ms")
    print(f"keeping contexts {sorted(hot)} ({sum(tokens[c] for c in hot)} tokens of {int(capacity // a.bytes_per_token)} "
          f"that fit): {hot_requests} requests on them "
          f"({hot_requests / n:.0%}), {best_cold} cold, mean about {best:.0f} ms: {measured / best:.2f}x at best")


if __name__ == "__main__":
    main()
