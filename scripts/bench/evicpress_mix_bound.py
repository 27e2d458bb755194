#!/usr/bin/env python3
"""How far any static per-context choice of codec can go at a fixed codec's quality, from a stored `bench tiers` run.

`evicpress_choice_bound.py` asks what choosing *which* contexts to keep in one codec can buy. This script asks the
wider question EvicPress's Algorithm 1 answers: give each context one variant (f16, one of the run's codecs, or
dropped), knowing in advance how often every context is asked for, within the run's host + disk bytes. What is the
lowest mean TTFT such a placement reaches at a target mean quality (by default the quality of `--baseline`)?

Arithmetic on one measured run that has `recompute`, `lru` and every `lru+CODEC` configuration (`--offline-phase`,
so every context is stored before the measured requests and no first touch is forced cold):
- A request on a dropped context costs what recompute's same request measured, and scores 1.
- A request on a context kept in variant V costs what `lru+V` (`lru` for f16) measured for that request if that run
  served it from its tiers or device, else that run's mean over the requests it served so. It scores the variant's
  mean quality over the requests that run served from a copy. (Per-request qualities would let the placement pick,
  context by context, whichever codec happened to score best on that context's few requests: noise, not a choice
  any planner could make.)
- A variant's size is its bits per element from the codec format table (`kernels/src/codec.rs`) times a context's
  shortest prompt.
The placement is optimised exactly over bytes (dynamic programming in MiB) for each Lagrange weight on quality;
every point printed is a placement that fits, with its modelled TTFT and quality. The device pool (a few contexts)
is left out, which makes every placement a little slower than the runs it is compared with.

    python3 scripts/bench/evicpress_mix_bound.py docs/bench-tiers-zipf-full-seeded.json
"""
import argparse
import collections
import json

# Bits per element of a 16-slot, 64-channel block, header and scales included (`Codec::bits_per_element`).
BITS = {"f16": 16.06, "int8": 8.56, "fp8_e4m3": 8.09, "int4_kivi": 5.56, "int2_kivi": 3.56}
# SmolLM2-135M: 30 layers x 3 kv-heads x 64 dims x (K, V).
ELEMENTS_PER_TOKEN = 30 * 3 * 64 * 2
MIB = 1 << 20


def served_from_copy(r):
    return r["computed_tokens"] < r["prompt_tokens"] and any(r["hit_tokens"])


def variant_table(rows):
    """Per request (cost ms, quality) when its context is held in this run's variant."""
    warm = [r for r in rows if served_from_copy(r)]
    mean_ms = sum(r["ttft_ms"] for r in warm) / len(warm)
    mean_q = sum(r["quality"] for r in warm) / len(warm)
    return [(r["ttft_ms"] if served_from_copy(r) else mean_ms, mean_q) for r in rows], mean_q


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--baseline", default="lru+int4_kivi")
    ap.add_argument("--target-quality", type=float, help="default: the baseline's measured quality")
    a = ap.parse_args()
    run = json.load(open(a.json))
    results = {r["name"]: r for r in run["results"]}
    rows = {name: r["per_request"] for name, r in results.items()}
    n = len(rows["recompute"])
    contexts = sorted({r["context"] for r in rows["recompute"]})
    tokens = {}
    for r in rows["recompute"]:
        tokens[r["context"]] = min(tokens.get(r["context"], r["prompt_tokens"]), r["prompt_tokens"])
    requests = collections.defaultdict(list)
    for i, r in enumerate(rows["recompute"]):
        requests[r["context"]].append(i)

    variants = {"drop": ([(r["ttft_ms"], 1.0) for r in rows["recompute"]], 1.0)}
    variants["f16"] = variant_table(rows["lru"])
    for codec in run["options"]["codecs"]:
        if f"lru+{codec}" in rows:
            variants[codec] = variant_table(rows[f"lru+{codec}"])
    names = list(variants)

    def size_mib(c, v):
        if v == "drop":
            return 0
        return -(-int(tokens[c] * ELEMENTS_PER_TOKEN * BITS[v] / 8) // MIB)

    capacity = run["options"]["host_mib"] + run["options"]["disk_mib"]
    cost = {(c, v): sum(variants[v][0][i][0] for i in requests[c]) for c in contexts for v in names}
    qsum = {(c, v): sum(variants[v][0][i][1] for i in requests[c]) for c in contexts for v in names}

    def place(weight):
        """The placement minimising total TTFT - weight x total quality within `capacity` MiB."""
        inf = float("inf")
        best = [0.0] + [inf] * capacity
        choice = []
        for c in contexts:
            nxt = [inf] * (capacity + 1)
            pick = [None] * (capacity + 1)
            for v in names:
                s, val = size_mib(c, v), cost[(c, v)] - weight * qsum[(c, v)]
                for used in range(capacity + 1 - s):
                    if best[used] + val < nxt[used + s]:
                        nxt[used + s], pick[used + s] = best[used] + val, (v, used)
            best = nxt
            choice.append(pick)
        used = min(range(capacity + 1), key=lambda u: best[u])
        plan = {}
        for c, pick in zip(reversed(contexts), reversed(choice)):
            v, used = pick[used]
            plan[c] = v
        ttft = sum(cost[(c, v)] for c, v in plan.items()) / n
        quality = sum(qsum[(c, v)] for c, v in plan.items()) / n
        return ttft, quality, collections.Counter(plan.values())

    target = a.target_quality if a.target_quality is not None else results[a.baseline]["quality"]
    baseline_ms = results[a.baseline]["ttft_ms_mean"]
    print(f"{n} requests over {len(contexts)} contexts, {capacity} MiB of tiers; variants {names}")
    for v in names:
        print(f"  {v}: quality when held {variants[v][1]:.3f}")
    print(f"baseline {a.baseline}: {baseline_ms:.1f} ms at {results[a.baseline]['quality']:.3f}; target {target:.3f}")
    fastest = None
    for weight in [0, 250, 500, 1000, 2000, 3000, 4000, 6000, 8000, 12000, 16000, 24000, 32000, 64000]:
        ttft, quality, mix = place(weight)
        meets = quality >= target
        print(f"weight {weight:>6} ms per unit of quality: {ttft:7.1f} ms at {quality:.3f} "
              f"{'(meets) ' if meets else ''}{dict(mix)}")
        if meets and (fastest is None or ttft < fastest[0]):
            fastest = (ttft, quality, weight)
    if fastest:
        print(f"fastest placement at >= {target:.3f}: {fastest[0]:.1f} ms at {fastest[1]:.3f} (weight {fastest[2]}): "
              f"{baseline_ms / fastest[0]:.2f}x below {a.baseline}")


if __name__ == "__main__":
    main()
