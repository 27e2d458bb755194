#!/usr/bin/env python3
"""What priority scheduling (`--scheduling-policy priority`) does for urgent requests under load, measured through
real `pagoda up` processes.

Starts two servers with the same `--max-running` (small, so requests queue on the worker): one in arrival order
(`fcfs`, the default) and one with `--scheduling-policy priority`. Against each in turn, round after round (the
order alternating), it runs `pagoda bench load` in a closed loop where every `--urgent-every`-th request is urgent:
it sends `"priority": -1` to the priority server, and nothing (priority 0) to the FCFS one, whose report still
keeps the class apart. Only one load runs at a time, so the servers never compete for the cores. Every answer is
checked against the greedy reference by `bench load` itself.

Per server it reports the medians over the rounds of the urgent and the other requests' TTFT (p50, p99) and the
generated tokens/s, and each figure's ratio to the FCFS server's.

    scripts/bench-priority.py [--bin target/release/pagoda] [--reps 3] [--duration 40] [--concurrency 16]
        [--max-running 4] [--urgent-every 4] [--max-tokens 64] [--json out.json]
"""

import argparse
import json
import statistics
import sys

from pagoda_servers import alternating, bench_load, start_servers, stop_servers


def load(a, url, priority):
    return bench_load(a.bin, url, ["--mode", "closed", "--concurrency", str(a.concurrency),
                                   "--duration-secs", str(a.duration), "--max-tokens", str(a.max_tokens),
                                   "--streaming", "all", "--urgent-every", str(a.urgent_every),
                                   f"--urgent-priority={priority}"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/pagoda")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--duration", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-running", type=int, default=4)
    ap.add_argument("--urgent-every", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--base-port", type=int, default=18580)
    ap.add_argument("--json")
    a = ap.parse_args()
    servers = {
        "fcfs": ([], 0),
        "priority": (["--scheduling-policy", "priority"], -1),
    }
    urls, procs = start_servers(a.bin, a.base_port, {name: flags for name, (flags, _) in servers.items()},
                                ["--threads", "2", "--max-running", str(a.max_running)], "bench-priority")
    try:
        runs = {name: [] for name in servers}
        for rep, name in alternating(a.reps, list(servers)):
            s = load(a, urls[name], servers[name][1])
            runs[name].append(s)
            print(f"round {rep + 1} {name}: urgent TTFT p50 {s['urgent']['p50_ttft_s']:.2f} s, others "
                  f"{s['others']['p50_ttft_s']:.2f} s, {s['completion_tokens_per_s']:.1f} tok/s", file=sys.stderr)
    finally:
        stop_servers(procs)

    cols = [("urgent", "p50_ttft_s"), ("urgent", "p99_ttft_s"), ("others", "p50_ttft_s"), ("others", "p99_ttft_s"),
            (None, "completion_tokens_per_s")]

    def med(name, cls, key):
        return statistics.median((r[cls] if cls else r)[key] for r in runs[name])

    print(f"closed loop of {a.concurrency} streams, --max-running {a.max_running}, every {a.urgent_every}th request "
          f"urgent, {a.max_tokens} tokens, {a.duration} s per run, {a.reps} rounds; medians over the rounds")
    print("| server | urgent TTFT p50 (s) | urgent TTFT p99 (s) | others TTFT p50 (s) | others TTFT p99 (s) | "
          "tokens/s | requests (urgent / others, all rounds) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in servers:
        vals = [med(name, c, k) for c, k in cols]
        base = [med("fcfs", c, k) for c, k in cols]
        cells = [f"{v:.2f} ({v / b:.2f}×)" if name != "fcfs" else f"{v:.2f}" for v, b in zip(vals, base)]
        n_urgent = sum(r["urgent"]["completed"] for r in runs[name])
        n_others = sum(r["others"]["completed"] for r in runs[name])
        print(f"| {name} | {' | '.join(cells)} | {n_urgent} / {n_others} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
