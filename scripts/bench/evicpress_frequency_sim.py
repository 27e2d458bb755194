#!/usr/bin/env python3
"""What EvicPress's placement could reach on the issue's Zipf workload if it knew each context's frequency.

A model of the full-size `pagoda bench tiers --workload zipf --offline-phase` run, not a run: 200 contexts of
1,024-4,096 tokens (whole 16-token groups), requests drawn by Zipf(1.1) over a seeded ranking, 3 GiB of host + disk
tiers, every context stored at full precision before the measured requests (the offline phase). Its costs and
qualities come from `docs/bench-tiers-zipf-full-seeded.json` (Q8_1 matmuls):
- a cold request costs the fit of that run's recompute TTFT over prompt length, 0.626 L + 0.000408 L^2 - 93.6 ms
  (so a 2,500-token context costs about 4 s); a request served from a copy costs 108 ms, the run's mean over the
  requests its fixed codecs served from a copy (99-117 ms by codec);
- a request served from a copy scores that codec's mean quality over such requests in that run (`QUALITY`); a cold
  one scores 1.

Three ways to place, each on the same requests:
- `lru+CODEC`: every context in CODEC, least recently used out first; a cold request stores its context again.
- `learned`: the utility placement with the frequencies an online planner could know: each context's count over
  `--warmup` unmeasured requests of the same distribution and the measured requests so far, plus `--prior` for
  every context. After each request the placement maximising sum(frequency x (alpha x quality - load time)), a
  drop priced as a recompute at quality 1, is solved exactly (dynamic programming in MiB), not greedily. A context
  can only go down in precision unless the request just recomputed it, as in the engine.
- `future`: the same optimisation with every context's count over the measured requests known in advance.
- `greedy`: Algorithm 1 as the engine runs it, on the learned frequencies: a stored or recomputed context goes in
  at f16, and while the tiers are over capacity the single change (a cheaper codec, or a drop) with the smallest
  utility drop (`--rule drop`) or drop per MiB freed (`--rule per-byte`) is applied. The offline phase's
  question counts as one access, as in the engine.
With `--profile-noise SD` the `greedy` and `learned` placements plan on per-context profiles: each lossy codec's
mean quality plus a normal error of that standard deviation, drawn once per context (clipped to [0, 1]), where the
engine's profiles come from a few questions of a few tokens each. Requests still score the codec's mean.
The learned placement is an upper bound on what Algorithm 1 can do with those frequencies: its profiles are exact
and its knapsack optimal. The script needs numpy.

    python3 scripts/bench/evicpress_frequency_sim.py --seeds 11,12,13 --warmup 0 [--rule drop] [--profile-noise 0.1]
"""
import argparse
from collections import OrderedDict

import numpy as np

BITS = {"f16": 16.06, "fp8_e4m3": 8.09, "int8": 8.56, "int4_kivi": 5.56, "int2_kivi": 3.56}
PRECISION = {"f16": 4, "fp8_e4m3": 3, "int8": 3, "int4_kivi": 2, "int2_kivi": 1}
QUALITY = {"f16": 1.0, "fp8_e4m3": 0.972, "int8": 0.897, "int4_kivi": 0.928, "int2_kivi": 0.620}
VARIANTS = ("drop", "f16", "fp8_e4m3", "int8", "int4_kivi", "int2_kivi")
ELEMENTS_PER_TOKEN = 30 * 3 * 64 * 2
CAPACITY_MIB = 3072
WARM_MS = 108.0


def cold_ms(tokens):
    return 0.626 * tokens + 0.000408 * tokens * tokens - 93.6


def size_mib(tokens, variant):
    return 0 if variant == "drop" else -(-int(tokens * ELEMENTS_PER_TOKEN * BITS[variant] / 8) // (1 << 20))


def workload(seed, warmup, measured, contexts=200, zipf_s=1.1):
    rng = np.random.default_rng(seed)
    tokens = (rng.integers(1024, 4097, contexts) // 16) * 16
    ranking = rng.permutation(contexts)
    p = 1.0 / np.arange(1, contexts + 1) ** zipf_s
    requests = ranking[rng.choice(contexts, warmup + measured, p=p / p.sum())]
    return tokens, requests


def lru(tokens, requests, warmup, codec):
    held, used = OrderedDict(), 0

    def store(c):
        nonlocal used
        size = size_mib(tokens[c], codec)
        while used + size > CAPACITY_MIB and held:
            used -= held.popitem(last=False)[1]
        held[c] = size
        used += size

    for c in range(len(tokens)):
        store(c)
    ttft, quality = [], []
    for k, c in enumerate(requests):
        if c in held:
            held.move_to_end(c)
            t, q = WARM_MS, QUALITY[codec]
        else:
            t, q = cold_ms(tokens[c]), 1.0
            store(c)
        if k >= warmup:
            ttft.append(t)
            quality.append(q)
    return float(np.mean(ttft)), float(np.mean(quality))


def planning_quality(contexts, noise_sd, seed):
    """What the planner believes each context's variants score: the codec's mean, plus profile noise."""
    rng = np.random.default_rng(seed + 1000)
    believed = []
    for _ in range(contexts):
        q = {v: QUALITY[v] for v in QUALITY}
        for v in QUALITY:
            if v != "f16" and noise_sd > 0:
                q[v] = float(np.clip(q[v] + rng.normal(0, noise_sd), 0, 1))
        believed.append(q)
    return believed


def place(tokens, frequency, allowed, alpha, believed):
    """The placement maximising the summed utility within the tiers' MiB: a multiple-choice knapsack, solved exactly."""
    none = -1e18
    best = np.full(CAPACITY_MIB + 1, none)
    best[0] = 0.0
    picks = []
    for c, length in enumerate(tokens):
        nxt = np.full(CAPACITY_MIB + 1, none)
        pick = np.full(CAPACITY_MIB + 1, -1)
        for j, v in enumerate(VARIANTS):
            if v not in allowed[c]:
                continue
            size = size_mib(length, v)
            if v == "drop":
                value = frequency[c] * (alpha - cold_ms(length) / 1000)
            else:
                value = frequency[c] * (alpha * believed[c][v] - WARM_MS / 1000)
            candidate = np.full(CAPACITY_MIB + 1, none)
            candidate[size:] = best[: CAPACITY_MIB + 1 - size] + value
            better = candidate > nxt
            nxt[better], pick[better] = candidate[better], j
        picks.append(pick)
        best = nxt
    used, out = int(np.argmax(best)), [None] * len(tokens)
    for c in range(len(tokens) - 1, -1, -1):
        out[c] = VARIANTS[picks[c][used]]
        used -= size_mib(tokens[c], out[c])
    return out


def utility(frequency, tokens, quality, alpha):
    """The utility of one context: `quality` None for a drop (a recompute at quality 1)."""
    if quality is None:
        return frequency * (alpha - cold_ms(tokens) / 1000)
    return frequency * (alpha * quality - WARM_MS / 1000)


def greedy_placement(tokens, requests, warmup, alpha, rule, believed):
    n = len(tokens)
    frequency, placement, used = np.zeros(n), ["drop"] * n, 0

    def relieve():
        nonlocal used
        while used > CAPACITY_MIB:
            best = None
            for c, held in enumerate(placement):
                for v in VARIANTS:
                    if held == "drop" or (v != "drop" and PRECISION[v] >= PRECISION[held]):
                        continue
                    freed = size_mib(tokens[c], held) - size_mib(tokens[c], v)
                    if freed <= 0:
                        continue
                    worth = [None if x == "drop" else believed[c][x] for x in (held, v)]
                    loss = utility(frequency[c], tokens[c], worth[0], alpha) - utility(
                        frequency[c], tokens[c], worth[1], alpha
                    )
                    key = loss / freed if rule == "per-byte" else loss
                    if best is None or key < best[0]:
                        best = (key, c, v, freed)
            _, c, v, freed = best
            placement[c] = v
            used -= freed

    def store(c):
        nonlocal used
        placement[c] = "f16"
        used += size_mib(tokens[c], "f16")
        relieve()

    for c in range(n):
        frequency[c] += 1
        store(c)
    ttft, quality = [], []
    for k, c in enumerate(requests):
        variant = placement[c]
        t, q = (cold_ms(tokens[c]), 1.0) if variant == "drop" else (WARM_MS, QUALITY[variant])
        frequency[c] += 1
        if variant == "drop":
            store(c)
        if k >= warmup:
            ttft.append(t)
            quality.append(q)
    return float(np.mean(ttft)), float(np.mean(quality))


def utility_placement(tokens, requests, warmup, alpha, prior, future, believed):
    n = len(tokens)
    anything = set(VARIANTS)
    if future:
        frequency = np.bincount(requests[warmup:], minlength=n).astype(float)
    else:
        frequency = np.full(n, prior)
    placement = place(tokens, frequency, [anything] * n, alpha, believed)
    ttft, quality = [], []
    for k, c in enumerate(requests):
        variant = placement[c]
        recomputed = variant == "drop"
        t, q = (cold_ms(tokens[c]), 1.0) if recomputed else (WARM_MS, QUALITY[variant])
        if k >= warmup:
            ttft.append(t)
            quality.append(q)
        if future:
            continue
        frequency[c] += 1
        allowed = []
        for i, held in enumerate(placement):
            if i == c and recomputed:
                allowed.append(anything)
            elif held == "drop":
                allowed.append({"drop"})
            else:
                allowed.append({"drop"} | {v for v in VARIANTS[1:] if v == held or PRECISION[v] < PRECISION[held]})
        placement = place(tokens, frequency, allowed, alpha, believed)
    return float(np.mean(ttft)), float(np.mean(quality))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="11,12,13")
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--prior", type=float, default=0.5)
    ap.add_argument("--alpha", default="4,6,8,10,12,16")
    ap.add_argument("--baseline", default="int4_kivi")
    ap.add_argument("--rule", choices=["drop", "per-byte"], default="per-byte")
    ap.add_argument("--profile-noise", type=float, default=0.0)
    ap.add_argument("--placements", default="greedy,learned,future")
    a = ap.parse_args()
    alphas = [float(x) for x in a.alpha.split(",")]
    for seed in [int(s) for s in a.seeds.split(",")]:
        tokens, requests = workload(seed, a.warmup, a.requests)
        believed = planning_quality(len(tokens), a.profile_noise, seed)
        base_ms, base_q = lru(tokens, requests, a.warmup, a.baseline)
        print(f"seed {seed}: lru+{a.baseline} {base_ms:.1f} ms at {base_q:.3f}")
        for label in a.placements.split(","):
            best = None
            for alpha in alphas:
                if label == "greedy":
                    ms, q = greedy_placement(tokens, requests, a.warmup, alpha, a.rule, believed)
                else:
                    exact = planning_quality(len(tokens), 0.0, seed) if label == "future" else believed
                    ms, q = utility_placement(tokens, requests, a.warmup, alpha, a.prior, label == "future", exact)
                print(f"  {label} alpha={alpha:g}: {ms:.1f} ms at {q:.3f}")
                if q >= base_q and (best is None or ms < best[0]):
                    best = (ms, q, alpha)
            if best:
                print(f"  {label}: fastest at >= {base_q:.3f}: alpha={best[2]:g}, {base_ms / best[0]:.2f}x below lru+{a.baseline}")
            else:
                print(f"  {label}: no alpha reaches {base_q:.3f}")


if __name__ == "__main__":
    main()
