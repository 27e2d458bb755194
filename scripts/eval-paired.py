#!/usr/bin/env python3
"""The eviction issue's orderings and its 95% bar, read from a `pagoda eval --json` report, item by item.

Usage: scripts/eval-paired.py REPORT.json [TASK,TASK,...] [--lane NAME=FILE:POLICY]... [--pair A,B]...

For the synthetic tasks given (default: every task in the report but prose), pooled over their items:
- each policy's mean score per budget, as a share of the full cache's on the same items, with the standard error
  of the mean;
- each ordering of the issue (paged_eviction against streaming and knorm, keydiff against knorm, kv_compress
  against snapkv) as the mean per-item difference with its standard error. The two lanes of a pair ran on the same
  items, so the paired difference is far less noisy than the difference of two means.

`--lane NAME=FILE:POLICY` adds the POLICY lanes of another report (a one-off build's, say) under the name NAME, on
the items both reports hold. `--pair A,B` adds A − B to the orderings, and for those pairs a table of how many items
score the same under both and how many get the very same answer.
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


def parse_args(argv):
    positional, lanes, pairs = [], [], []
    it = iter(argv)
    for a in it:
        if a == "--lane":
            name, spec = next(it).split("=", 1)
            path, policy = spec.rsplit(":", 1)
            lanes.append((name, path, policy))
        elif a == "--pair":
            pairs.append(tuple(next(it).split(",")))
        else:
            positional.append(a)
    return positional, lanes, pairs


def main():
    positional, lanes, pairs = parse_args(sys.argv[1:])
    if not positional:
        sys.exit(__doc__)
    report = json.load(open(positional[0]))
    items = [i for i in report["items"] if not i["task"].startswith("prose")]
    for name, path, policy in lanes:
        extra = json.load(open(path))["items"]
        items += [dict(i, policy=name) for i in extra if i["policy"] == policy]
    tasks = positional[1].split(",") if len(positional) > 1 else sorted({i["task"] for i in items})
    items = [i for i in items if i["task"] in tasks]
    if not items:
        sys.exit(f"no items of {tasks} in {positional[0]}")
    score = {(i["item"], i["policy"], i["budget"]): i["score"] for i in items}
    output = {(i["item"], i["policy"], i["budget"]): i.get("output") for i in items}
    # Items every added lane ran, so that every row compares the same items.
    names = {i["item"] for i in items if i["policy"] == "full"}
    for name in {name for name, _, _ in lanes}:
        names &= {i["item"] for i in items if i["policy"] == name}
    names = sorted(names)
    score = {k: v for k, v in score.items() if k[0] in names}
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
    for a, b in ORDERINGS + pairs:
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
    if pairs:
        print("\n| pair: same score, same answer | " + " | ".join(str(b) for b in budgets) + " |")
        print("|---|" + "---:|" * len(budgets))
        for a, b in pairs:
            cells = []
            for bud in budgets:
                both = [n for n in names if (n, a, bud) in score and (n, b, bud) in score]
                same = sum(score[(n, a, bud)] == score[(n, b, bud)] for n in both)
                answer = sum(output[(n, a, bud)] == output[(n, b, bud)] for n in both)
                cells.append(f"{same}/{len(both)}, {answer}/{len(both)}")
            print(f"| {a}, {b} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
