#!/usr/bin/env python3
"""Where KV-Compress spends its budget, from the `KVC-ALLOC` lines that the one-off build of
`docs/ablations/kv-compress-print-allocation.patch` prints (one line per compression: the target, then each layer's
kept blocks per kv-head, `h0/h1/...`).

Usage: pagoda eval ... 2>&1 | grep KVC-ALLOC | scripts/kvc-allocation.py

Prints each layer's kept blocks (the median over the lines), then the share of the budget that layers 0-2, 3-12 and
13-last keep against an even share, and the fewest and most blocks any single head keeps.
"""

import statistics
import sys


def main():
    rows = []
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] != "KVC-ALLOC":
            continue
        rows.append([[int(h) for h in layer.split("/")] for layer in parts[2:]])
    if not rows:
        sys.exit(__doc__)
    n_layers, n_heads = len(rows[0]), len(rows[0][0])
    per_layer = [[sum(r[l]) for l in range(n_layers)] for r in rows]
    total = sum(per_layer[0])
    print(f"{len(rows)} compressions; {total} blocks kept over {n_layers} layers x {n_heads} kv-heads; "
          f"an even share is {total / n_layers:g} a layer\n")
    print("| layers | " + " | ".join(f"+{i}" for i in range(10)) + " |")
    print("|---|" + "---:|" * 10)
    medians = [statistics.median(r[l] for r in per_layer) for l in range(n_layers)]
    for a in range(0, n_layers, 10):
        print(f"| {a}–{min(a + 9, n_layers - 1)} | " + " | ".join(f"{m:g}" for m in medians[a:a + 10]) + " |")
    print()
    for a, b in [(0, 3), (3, 13), (13, n_layers)]:
        share = statistics.median(sum(r[a:b]) / sum(r) for r in per_layer)
        print(f"layers {a}-{b - 1}: {100 * share:.0f}% of the blocks, {share * n_layers / (b - a):.2f}x an even share")
    heads = [h for r in rows for layer in r for h in layer]
    print(f"single heads keep {min(heads)} to {max(heads)} blocks")


if __name__ == "__main__":
    main()
