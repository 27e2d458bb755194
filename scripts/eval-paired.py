#!/usr/bin/env python3
"""The eviction issue's orderings and its 95% bar, read from a `pagoda eval --json` report, item by item.

Usage: scripts/eval-paired.py REPORT.json [TASK,TASK,...]

For the synthetic tasks given (default: every task in the report but prose), pooled over their items:
- each policy's mean score per budget, as a share of the full cache's on the same items, with the standard error
  of the mean;
- each ordering of the issue (paged_eviction against streaming and knorm, keydiff against knorm, kv_compress
  against snapkv) as the mean per-item difference with its standard error. The two lanes of a pair ran on the same
  items, so the paired difference is far less noisy than the difference of two means.
"""

import json
import math
import sys
from collections import defaultdict

ORDERINGS = [
    ("paged_eviction", "streaming"),
    ("paged_eviction", "knorm"),
    ("keydiff", "knorm"),
    ("kv_compress", "snapkv"),
]


def mean_se(values):
    n = len(values)
    m = sum(values) / n
    if n < 2:
        return m, 0.0
    var = sum((v - m) ** 2 for v in values) / (n - 1)
    return m, math.sqrt(var / n)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    report = json.load(open(sys.argv[1]))
    items = [i for i in report["items"] if not i["task"].startswith("prose")]
    tasks = sys.argv[2].split(",") if len(sys.argv) > 2 else sorted({i["task"] for i in items})
    items = [i for i in items if i["task"] in tasks]
    if not items:
        sys.exit(f"no items of {tasks} in {sys.argv[1]}")
    score = {(i["item"], i["policy"], i["budget"]): i["score"] for i in items}
    names = sorted({i["item"] for i in items})
    budgets = sorted({i["budget"] for i in items if i["budget"] > 0})
    policies = [p for p in dict.fromkeys(i["policy"] for i in items) if p != "full"]
    full_mean, full_se = mean_se([score[(n, "full", 0)] for n in names])
    print(f"tasks: {', '.join(tasks)}; {len(names)} items; full cache {full_mean:.3f} ± {full_se:.3f}\n")
    print("| policy | " + " | ".join(str(b) for b in budgets) + " |")
    print("|---|" + "---:|" * len(budgets))
    by_cell = defaultdict(list)
    for (n, p, b), s in score.items():
        by_cell[(p, b)].append(s)
    for p in policies:
        cells = []
        for b in budgets:
            if (p, b) not in by_cell:
                cells.append("–")
                continue
            m, se = mean_se(by_cell[(p, b)])
            cells.append(f"{m:.3f} ± {se:.3f} ({100 * m / full_mean:.0f}%)" if full_mean > 0 else f"{m:.3f}")
        print(f"| {p} | " + " | ".join(cells) + " |")
    print("\n| ordering | " + " | ".join(str(b) for b in budgets) + " |")
    print("|---|" + "---:|" * len(budgets))
    for a, b in ORDERINGS:
        cells = []
        for bud in budgets:
            diffs = [score[(n, a, bud)] - score[(n, b, bud)] for n in names
                     if (n, a, bud) in score and (n, b, bud) in score]
            if not diffs:
                cells.append("–")
                continue
            m, se = mean_se(diffs)
            cells.append(f"{m:+.3f} ± {se:.3f}")
        print(f"| {a} − {b} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
