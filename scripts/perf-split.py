#!/usr/bin/env python3
"""Splits the CPU time of `perf record` runs of the engine into the kinds of work a forward step does.

Usage: scripts/perf-split.py PERF.DATA [PERF.DATA ...]

Per file: samples of the quantised matmul (weights × Q8_1 activations, and the activations' quantisation), decode
attention (the grouped kernel a decode row goes through), prefill attention (the rows kernel of prompt chunks) and
everything else, as counts and shares. With two or more files, the ratio of each kind to the first file's: where
one configuration's time went down, and by how much, kind by kind.
"""
import re
import subprocess
import sys

KINDS = [
    ("matmul", re.compile(r"quant_rows_x16|quantize_rows_q8_1|matmul::matmul|bf16_rows|amx")),
    ("decode attention", re.compile(r"attend_group|attend_one")),
    ("prefill attention", re.compile(r"enter_scored|scores16_t|attend_rows")),
]


def split(path):
    out = subprocess.run(
        ["perf", "report", "-i", path, "--no-children", "-s", "sym", "-g", "none", "-n", "--stdio"],
        check=True, capture_output=True, text=True,
    ).stdout
    counts = {name: 0 for name, _ in KINDS}
    counts["other"] = 0
    for line in out.splitlines():
        fields = line.split()
        if line.startswith("#") or len(fields) < 3 or not fields[0].endswith("%"):
            continue
        samples, symbol = int(fields[1]), fields[-1]
        kind = next((name for name, rx in KINDS if rx.search(symbol)), "other")
        counts[kind] += samples
    return counts


def main():
    paths = sys.argv[1:]
    if not paths:
        sys.exit(__doc__)
    splits = [split(p) for p in paths]
    kinds = [name for name, _ in KINDS] + ["other", "total"]
    for s in splits:
        s["total"] = sum(s.values())
    print("| kind | " + " | ".join(paths) + (" | " + " | ".join(f"first / {p}" for p in paths[1:]) if paths[1:] else "") + " |")
    print("|---|" + "---:|" * (2 * len(paths) - 1))
    for k in kinds:
        cells = [f"{s[k]} ({s[k] / s['total']:.1%})" for s in splits]
        ratios = [f"{splits[0][k] / s[k]:.3f}" if s[k] else "—" for s in splits[1:]]
        print(f"| {k} | " + " | ".join(cells + ratios) + " |")


if __name__ == "__main__":
    main()
