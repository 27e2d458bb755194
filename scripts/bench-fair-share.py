#!/usr/bin/env python3
"""What fair scheduling (`--scheduling-policy fair`) does for a light tenant beside a heavy one, measured through
real `pagoda up` processes with API keys.

Starts two servers with the same small `--max-running` (so requests queue on the worker) and the same keys file
of two tenants, `heavy` and `light`: one serving in arrival order (`fcfs`, the default) and one with
`--scheduling-policy fair`. Against each in turn, round after round (the order alternating), it runs two
`pagoda bench load` closed loops at once for the same time: the heavy tenant's `--heavy-concurrency` streams and
the light tenant's `--light-concurrency` streams. Only one server is loaded at a time. The loads skip the greedy
reference (`--no-reference`), whose own requests would not start and stop together with the other tenant's;
`worker/tests/engine_scheduler.rs` checks that fair scheduling changes no answer.

Per server it reports the medians over the rounds of each tenant's TTFT (p50, p99) and generated tokens/s, and
each figure's ratio to the FCFS server's.

`--policies` picks the servers (default `fcfs,fair`; `vtc` is the token-fair scheduler). With
`--heavy-prompt-words N` the heavy tenant's prompts start with N words of filler notes, different in every round
(`pagoda bench load --prompt-words`, 200 prompts), so they are long and never cached: then the table also has each
tenant's service, VTC's cost of what it received per second (prompt tokens + 2 x generated tokens), and the
ratio of the heavy tenant's to the light one's.

    scripts/bench-fair-share.py [--bin target/release/pagoda] [--reps 3] [--duration 30] [--heavy-concurrency 16]
        [--light-concurrency 2] [--max-running 4] [--max-tokens 64] [--heavy-weight 1] [--policies fcfs,fair]
        [--heavy-prompt-words 0] [--json out.json]
    scripts/bench-fair-share.py --report out.json    # the tables again from a saved run, without running anything
"""

import argparse
import json
import statistics
import sys
import tempfile
import threading

from pagoda_servers import alternating, bench_load, start_servers, stop_servers

KEYS = {"heavy": "sk-bench-heavy-0123456789", "light": "sk-bench-light-0123456789"}


def load_both(a, url, round_seed):
    """Runs both tenants' loads at once; returns {tenant: summary}."""
    out = {}

    def run(tenant, concurrency):
        flags = ["--api-key", KEYS[tenant], "--mode", "closed", "--concurrency", str(concurrency), "--duration-secs",
                 str(a.duration), "--max-tokens", str(a.max_tokens), "--streaming", "all", "--no-reference"]
        if tenant == "heavy" and a.heavy_prompt_words:
            flags += ["--prompt-words", str(a.heavy_prompt_words), "--prompt-seed", str(round_seed),
                      "--shared-prompts", "0", "--unique-prompts", "200"]
        out[tenant] = bench_load(a.bin, url, flags)

    threads = [threading.Thread(target=run, args=("heavy", a.heavy_concurrency)),
               threading.Thread(target=run, args=("light", a.light_concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if set(out) != set(KEYS):
        sys.exit("a load failed")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/pagoda")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--duration", type=int, default=30)
    ap.add_argument("--heavy-concurrency", type=int, default=16)
    ap.add_argument("--light-concurrency", type=int, default=2)
    ap.add_argument("--max-running", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--heavy-weight", type=int, default=1, help="the heavy tenant's key's weight= (light: 1)")
    ap.add_argument("--policies", default="fcfs,fair", help="servers' --scheduling-policy, fcfs first")
    ap.add_argument("--heavy-prompt-words", type=int, default=0, help="filler words before each heavy prompt")
    ap.add_argument("--base-port", type=int, default=18600)
    ap.add_argument("--json")
    ap.add_argument("--report", help="print the tables of a run saved with --json instead of running")
    a = ap.parse_args()
    if a.report:
        with open(a.report) as f:
            saved = json.load(f)
        # Runs saved before an option existed ran with its default.
        report(argparse.Namespace(**{**vars(ap.parse_args([])), **saved["args"]}), saved["runs"])
        return
    keys = tempfile.NamedTemporaryFile("w", suffix=".keys", delete=False)
    weights = {"heavy": a.heavy_weight, "light": 1}
    keys.write("".join(f"{key} {tenant} weight={weights[tenant]}\n" for tenant, key in KEYS.items()))
    keys.close()
    policies = a.policies.split(",")
    if policies[0] != "fcfs":
        sys.exit("--policies must start with fcfs, the baseline")
    servers = {name: ["--scheduling-policy", name] for name in policies}
    common = ["--threads", "2", "--max-running", str(a.max_running), "--api-keys-file", keys.name]
    urls, procs = start_servers(a.bin, a.base_port, servers, common, "bench-fair-share")
    try:
        runs = {name: [] for name in servers}
        for i, (rep, name) in enumerate(alternating(a.reps, list(servers))):
            s = load_both(a, urls[name], 1000 + i)
            runs[name].append(s)
            print(f"round {rep + 1} {name}: light TTFT p50 {s['light']['p50_ttft_s']:.2f} s, heavy "
                  f"{s['heavy']['p50_ttft_s']:.2f} s, tokens/s {s['light']['completion_tokens_per_s']:.1f} + "
                  f"{s['heavy']['completion_tokens_per_s']:.1f}", file=sys.stderr)
    finally:
        stop_servers(procs)
    report(a, runs)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "runs": runs}, f, indent=1)


def report(a, runs):
    """Prints the medians table of `runs` ({server: [round summaries]}) and, with long heavy prompts, the figures
    the service columns rest on."""
    servers = list(runs)
    for rounds in runs.values():
        for r in rounds:
            for t in (r["light"], r["heavy"]):
                t["service_per_s"] = t.get("prompt_tokens_per_s", 0.0) + 2 * t["completion_tokens_per_s"]
            r["ratio"] = {"service": r["heavy"]["service_per_s"] / max(r["light"]["service_per_s"], 1e-9)}
    cols = [("light", "p50_ttft_s"), ("light", "p99_ttft_s"), ("light", "completion_tokens_per_s"),
            ("heavy", "p50_ttft_s"), ("heavy", "p99_ttft_s"), ("heavy", "completion_tokens_per_s")]
    headers = ["light TTFT p50 (s)", "light TTFT p99 (s)", "light tokens/s", "heavy TTFT p50 (s)",
               "heavy TTFT p99 (s)", "heavy tokens/s"]
    if a.heavy_prompt_words:
        cols += [("light", "service_per_s"), ("heavy", "service_per_s"), ("ratio", "service")]
        headers += ["light service/s", "heavy service/s", "service heavy : light"]

    def med(name, tenant, key):
        return statistics.median(r[tenant][key] for r in runs[name])

    print(f"closed loops of {a.heavy_concurrency} (heavy, weight {a.heavy_weight}) and {a.light_concurrency} (light) "
          "streams at once, "
          f"--max-running {a.max_running}, {a.max_tokens} tokens, {a.duration} s per run, {a.reps} rounds; medians")
    if a.heavy_prompt_words:
        print(f"heavy prompts start with {a.heavy_prompt_words} filler words (uncached); service = prompt tokens/s + "
              "2 x generated tokens/s")
    print(f"| server | {' | '.join(headers)} | requests (light / heavy, all rounds) |")
    print("|---|" + "---:|" * (len(headers) + 1))
    for name in servers:
        vals = [med(name, t, k) for t, k in cols]
        base = [med("fcfs", t, k) for t, k in cols]
        cells = [f"{v:.2f} ({v / b:.2f}×)" if name != "fcfs" and b else f"{v:.2f}" for v, b in zip(vals, base)]
        done = [sum(r[t]["completed"] for r in runs[name]) for t in ("light", "heavy")]
        print(f"| {name} | {' | '.join(cells)} | {done[0]} / {done[1]} |")
    for name in servers:
        totals = [r["light"]["completion_tokens_per_s"] + r["heavy"]["completion_tokens_per_s"] for r in runs[name]]
        print(f"{name}: both tenants together generate {min(totals):.0f}-{max(totals):.0f} tokens/s per round "
              f"(median {statistics.median(totals):.0f})")
    if not a.heavy_prompt_words:
        return
    per_request = {t: statistics.median(r[t]["prompt_tokens_per_s"] * r[t]["wall_s"] / max(r[t]["completed"], 1)
                                        for rounds in runs.values() for r in rounds) for t in ("light", "heavy")}
    print(f"prompt tokens per request (median over every run): light {per_request['light']:.0f}, heavy "
          f"{per_request['heavy']:.0f}")
    for name in servers:
        ratios = [r["ratio"]["service"] for r in runs[name]]
        total = med(name, "light", "service_per_s") + med(name, "heavy", "service_per_s")
        print(f"{name}: service heavy : light per round {min(ratios):.2f}-{max(ratios):.2f}; the two service medians "
              f"add up to {total:.0f} weighted tokens/s")


if __name__ == "__main__":
    main()
