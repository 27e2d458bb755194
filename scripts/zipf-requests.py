#!/usr/bin/env python3
"""Takes apart a `pagoda bench tiers --workload zipf --json` report, request by request.

Usage: scripts/zipf-requests.py REPORT.json [BASELINE CONFIG [CONTEXT]]

With the report alone, it prints for every configuration:
- recompute's prefill speed by prompt length (not under `--arrival-rate`, where its TTFT is mostly queueing) (prompt tokens / TTFT, requests grouped to the nearest 1K tokens),
  and the least-squares fit `TTFT = a * n + b * n(n+1)/2` over its requests (the cost model's prefill price,
  `worker/src/tiers/cost.rs`, fitted end to end), with the speed it predicts at 1K and 4K tokens;
- for every other configuration, its requests split into first touches (a context's first request in the run)
  and repeats: how many were cold (more than half the prompt computed), their mean quality, and their share of
  the mean TTFT; every cold request's prompt tokens (count, sum, mean, largest); the cold first touches' mean
  prompt length; the warm first touches by the tier that served most
  of their prompt, with their quality;
- for EvicPress, each variant's mean profiled quality and, per tier, the contexts placed at the end and their
  mean bytes, beside the workload's mean context in the device format.

With BASELINE and CONFIG, it compares the two: how many requests each side computed (more than half their prompt)
where the other reused stored KV, with the TTFT and quality those requests moved, and, with CONTEXT, every request
on that context side by side (prompt tokens served from device, host and disk, computed tokens, quality, TTFT ms).
"""
import collections
import json
import sys


def cold(r):
    return r["computed_tokens"] > r["prompt_tokens"] / 2


def prefill(recompute):
    by_length = collections.defaultdict(list)
    for r in recompute:
        by_length[round(r["prompt_tokens"] / 1024)].append(r)
    print("recompute: prompt tokens/s by prompt length")
    for k in sorted(by_length):
        rs = by_length[k]
        rate = sum(r["prompt_tokens"] for r in rs) / sum(r["ttft_ms"] for r in rs) * 1000
        print(f"  ~{k}K tokens: {len(rs):3} requests, {rate:6.0f} tokens/s")
    # Normal equations of TTFT (s) on (n, n(n+1)/2), no intercept, as `PrefillFit` in tiers/cost.rs.
    rows = [(r["prompt_tokens"], r["prompt_tokens"] * (r["prompt_tokens"] + 1) / 2, r["ttft_ms"] / 1000)
            for r in recompute]
    tt = sum(t * t for t, _, _ in rows)
    tp = sum(t * p for t, p, _ in rows)
    pp = sum(p * p for _, p, _ in rows)
    ty = sum(t * y for t, _, y in rows)
    py = sum(p * y for _, p, y in rows)
    det = tt * pp - tp * tp
    a, b = (ty * pp - py * tp) / det, (py * tt - ty * tp) / det
    if a <= 0 or b < 0:
        a, b = ty / tt, 0.0
    print(f"  fit: a = {a * 1e3:.3f} ms per token, b = {b * 1e6:.3f} us per attended position")
    for n in (1024, 4096):
        attention = b * n * (n + 1) / 2
        secs = a * n + attention
        print(f"  predicted at {n} tokens: {n / secs:.0f} tokens/s, attention {attention / secs:.0%} of the time")


def requests(name, rs):
    seen = set()
    first, repeat = [], []
    for r in rs:
        (repeat if r["context"] in seen else first).append(r)
        seen.add(r["context"])

    def part(label, part_rs):
        if not part_rs:
            return f"no {label}"
        n_cold = sum(cold(r) for r in part_rs)
        quality = sum(r["quality"] for r in part_rs) / len(part_rs)
        share = sum(r["ttft_ms"] for r in part_rs) / len(rs)
        return f"{len(part_rs)} {label}: {n_cold} cold, quality {quality:.3f}, {share:.0f} ms of the mean"

    print(f"{name}:")
    print(f"  {part('first touches', first)}; {part('repeats', repeat)}")
    cold_all = [r["prompt_tokens"] for r in rs if cold(r)]
    if cold_all:
        print(f"  cold requests: {len(cold_all)}, {sum(cold_all)} prompt tokens, "
              f"{sum(cold_all) / len(cold_all):.0f} on average, at most {max(cold_all)}")
    cold_first = [r["prompt_tokens"] for r in first if cold(r)]
    if cold_first:
        print(f"  cold first touches: {sum(cold_first) / len(cold_first):.0f} prompt tokens on average")
    warm = [r for r in first if not cold(r)]
    for tier, label in enumerate(("device", "host", "disk")):
        # The tier that served most of the prompt; ties go to the slower tier, whose load the request paid.
        served = [r for r in warm if max(range(3), key=lambda t: (r["hit_tokens"][t], t)) == tier]
        if served:
            quality = sum(r["quality"] for r in served) / len(served)
            print(f"  warm first touches mostly from {label}: {len(served)}, quality {quality:.3f}")


def evicpress(ep, workload_bytes, contexts):
    qualities = ", ".join(f"{v} {q:.3f}" for v, q in zip(ep["variants"], ep["mean_quality"]))
    print(f"  profiled quality: {qualities}")
    print(f"  mean context in the device format: {workload_bytes / contexts / 1e6:.1f} MB")
    for label, tier in (("host", 1), ("disk", 2)):
        placed, planned = ep["placed"][tier], ep["planned_bytes"][tier]
        if placed:
            print(f"  {label}: {placed} contexts at {planned / placed / 1e6:.1f} MB on average "
                  f"({planned / 1e6:.0f} of {ep['capacity_bytes'][tier] / 1e6:.0f} MB)")
    if ep["placed"][2]:
        mean_disk = ep["planned_bytes"][2] / ep["placed"][2]
        room = ep["capacity_bytes"][1] + ep["capacity_bytes"][2]
        print(f"  host and disk would hold {room / mean_disk:.0f} contexts at the disk copies' mean size, "
              f"against {sum(ep['placed'])} placed")


def breakdown(report):
    for result in report["results"]:
        if result["name"] == "recompute" and report["options"].get("arrival_rate", 0) > 0:
            print("recompute: TTFT counts queueing under arrivals, so no prefill fit")
        elif result["name"] == "recompute":
            prefill(result["per_request"])
        else:
            requests(result["name"], result["per_request"])
        if result.get("evicpress"):
            evicpress(result["evicpress"], report["workload_kv_bytes"], report["options"]["contexts"])


def compare(report):
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


def main():
    if len(sys.argv) not in (2, 4, 5):
        sys.exit(__doc__)
    report = json.load(open(sys.argv[1]))
    if len(sys.argv) == 2:
        breakdown(report)
    else:
        compare(report)


if __name__ == "__main__":
    main()
