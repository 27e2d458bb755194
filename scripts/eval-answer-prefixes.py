#!/usr/bin/env python3
"""How much of a needle's value each policy's answer gets right, from a `pagoda eval --json` report.

Usage: scripts/eval-answer-prefixes.py REPORT.json [TASK]   (TASK defaults to multikey_niah)

On the items where the full cache's answer scored 1, the value is the first number of five or more digits in the
full cache's output (the needle's 7-digit value for multikey_niah). For every policy and budget this prints how
many such answers there are and, by the length of the longest correct prefix of the value in the lane's first
number, how many answers reach it; "all" counts the answers that hold the whole value as their first number's
start.
"""

import json
import re
import sys
from collections import Counter


def first_number(text, min_digits=1):
    m = re.search(r"\d{%d,}" % min_digits, text or "")
    return m.group(0) if m else ""


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    report = json.load(open(sys.argv[1]))
    task = sys.argv[2] if len(sys.argv) > 2 else "multikey_niah"
    items = [i for i in report["items"] if i["task"] == task]
    values = {}
    for i in items:
        if i["policy"] == "full" and i["score"] == 1.0:
            value = first_number(i["output"], 5)
            if value:
                values[i["item"]] = value
    if not values:
        sys.exit(f"no item of {task} that the full cache answered right in {sys.argv[1]}")
    lanes = {}
    for i in items:
        if i["policy"] == "full" or i["item"] not in values:
            continue
        value, got = values[i["item"]], first_number(i["output"])
        k = 0
        while k < min(len(value), len(got)) and value[k] == got[k]:
            k += 1
        lanes.setdefault((i["policy"], i["budget"]), Counter())["all" if k == len(value) else k] += 1
    print(f"{task}: {len(values)} items the full cache answered right")
    print("| policy | budget | answers | longest correct prefix: answers | whole value |")
    print("|---|---:|---:|---|---:|")
    for (policy, budget), c in sorted(lanes.items()):
        hist = ", ".join(f"{k}: {n}" for k, n in sorted((k, n) for k, n in c.items() if k != "all"))
        print(f"| {policy} | {budget} | {sum(c.values())} | {hist} | {c['all']} |")


if __name__ == "__main__":
    main()
