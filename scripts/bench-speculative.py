#!/usr/bin/env python3
"""What n-gram speculative decoding (`--speculative-tokens`) gains and costs, measured through real `pagoda up`
processes side by side.

Starts one server without speculation and one per `--ks` value (each with `--threads 2`; only one request runs at
a time, so they never compete for the cores), then streams the same chat requests to each in turn, round after
round. Per workload and server it reports the median decode rate (tokens after the first, over the time from the
first token to the last), its ratio to the server without speculation, the draft tokens accepted per step that
carried a draft, and whether every answer equals the plain server's. Workloads: answers that repeat their prompt
or themselves (counting, rewriting code, quoting a paragraph) and free text (a story, an explanation), greedy and
seeded at temperature 0.8; then `--concurrency` streams at once, where the per-server batch limit
(`--speculative-max-batch`, default 4) decides whether drafts run. With `--guided`, the workloads are JSON-schema
answers instead, whose keys the guide forces (drafted whole, `Sampler::forced_tokens`): one object of many
distinct keys, and a list of objects whose keys repeat. A server spec `K/N` sets the n-gram sizes to N
(`--speculative-ngram-min N --speculative-ngram-max N`); `/16` leaves only the guide's drafts.

    scripts/bench-speculative.py [--bin target/release/pagoda] [--ks 4,4@0,8/16] [--reps 5] [--tokens 128]
        [--concurrency 4,8] [--guided] [--json out.json]
"""

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

from pagoda_servers import wait_ready

MODEL = "SmolLM2-135M-Instruct.Q4_1"
CODE = '''def mean(xs):
    total = 0
    for x in xs:
        total += x
    return total / len(xs)


def variance(xs):
    m = mean(xs)
    total = 0
    for x in xs:
        total += (x - m) ** 2
    return total / len(xs)
'''
PARAGRAPH = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to "
             "do: once or twice she had peeped into the book her sister was reading, but it had no pictures or "
             "conversations in it, 'and what is the use of a book,' thought Alice 'without pictures or "
             "conversations?'")
WORKLOADS = {
    "count": "Count from 1 to 100, one number per line.",
    "code edit": f"Here is some Python code:\n\n```python\n{CODE}```\n\nAdd a docstring to each function and "
                 "output the full code.",
    "quote": f"Repeat this paragraph exactly, then say what it is about:\n\n{PARAGRAPH}",
    "story": "Write a short story about a robot who learns to paint.",
    "explain": "Explain in detail how a bicycle works.",
}
SAMPLINGS = {"greedy": {"temperature": 0}, "t=0.8": {"temperature": 0.8, "seed": 3}}


def schema_format(schema):
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}


CITY = {"type": "object", "additionalProperties": False, "properties": {
    "name_of_the_city": {"type": "string", "maxLength": 24},
    "country_it_belongs_to": {"type": "string", "maxLength": 24},
    "population_in_millions": {"type": "integer"},
    "lies_on_the_coast": {"type": "boolean"}},
    "required": ["name_of_the_city", "country_it_belongs_to", "population_in_millions", "lies_on_the_coast"]}
PROFILE = {"type": "object", "additionalProperties": False, "properties": {
    "official_name_of_the_city": {"type": "string", "maxLength": 30},
    "year_the_city_was_founded": {"type": "integer"},
    "most_famous_landmark_in_the_city": {"type": "string", "maxLength": 30},
    "main_river_flowing_through_it": {"type": "string", "maxLength": 30},
    "is_the_national_capital": {"type": "boolean"},
    "approximate_population_in_millions": {"type": "integer"},
    "best_season_for_a_visit": {"type": "string", "maxLength": 20}},
    "required": ["official_name_of_the_city", "year_the_city_was_founded", "most_famous_landmark_in_the_city",
                 "main_river_flowing_through_it", "is_the_national_capital",
                 "approximate_population_in_millions", "best_season_for_a_visit"]}
GUIDED_WORKLOADS = {
    "schema, one object": ("Describe Paris as JSON.", schema_format(PROFILE)),
    "schema, list": ("List ten large cities as JSON.", schema_format(
        {"type": "object", "additionalProperties": False, "required": ["cities"],
         "properties": {"cities": {"type": "array", "items": CITY, "maxItems": 40}}})),
}


def draft_counts(url):
    """(drafts, draft tokens, accepted tokens) so far, from the router's gauges."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    names = ["pagoda_router_worker_spec_drafts{", "pagoda_router_worker_spec_draft_tokens{",
             "pagoda_router_worker_spec_accepted_tokens{"]
    got = [0.0, 0.0, 0.0]
    for line in text.splitlines():
        for i, name in enumerate(names):
            if line.startswith(name):
                got[i] += float(line.rsplit(" ", 1)[1])
    return got


def stream(url, prompt, extra, tokens):
    """Streams one chat; returns (text, completion tokens, decode tokens/s after the first token)."""
    body = {"model": MODEL, "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": prompt}], **extra}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    text, first, last, usage = [], None, None, None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                piece = c.get("delta", {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(piece)
    n = usage["completion_tokens"]
    assert n == tokens, usage
    return "".join(text), n, (n - 1) / max(last - first, 1e-9)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/pagoda")
    ap.add_argument("--ks", default="4",
                    help="draft tokens per server with speculation, comma-separated; `K@C` also pins the cost of a "
                         "draft token to C (--speculative-draft-cost; 4@0 drafts 4 whenever a suffix matches)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="4,8")
    ap.add_argument("--base-port", type=int, default=18480)
    ap.add_argument("--guided", action="store_true", help="JSON-schema workloads instead of the free-text ones")
    ap.add_argument("--json")
    a = ap.parse_args()
    workloads = GUIDED_WORKLOADS if a.guided else {w: (p, {}) for w, p in WORKLOADS.items()}
    servers = {"off": []}
    for spec in a.ks.split(","):
        spec, _, ngram = spec.partition("/")
        k, _, cost = spec.partition("@")
        flags = ["--speculative-tokens", k] + (["--speculative-draft-cost", cost] if cost else [])
        if ngram:
            flags += ["--speculative-ngram-min", ngram, "--speculative-ngram-max", ngram]
        servers[f"k={k}" + (f", cost {cost}" if cost else "") + (f", n-grams of {ngram}" if ngram else "")] = flags
    procs, urls = [], {}
    try:
        for i, (name, flags) in enumerate(servers.items()):
            port = a.base_port + i
            urls[name] = f"http://127.0.0.1:{port}"
            log = open(f"/tmp/bench-speculative-{port}.log", "w")
            procs.append(subprocess.Popen([a.bin, "up", "--listen", f"127.0.0.1:{port}", "--threads", "2", *flags],
                                          stdout=log, stderr=subprocess.STDOUT))
        for (name, url), p in zip(urls.items(), procs):
            wait_ready(url, p)
            stream(url, "Say hi.", {"temperature": 0}, 8)  # warm up
        rows = {}
        for rep in range(a.reps):
            for w, (prompt, guide) in workloads.items():
                for s, extra in SAMPLINGS.items():
                    for name, url in urls.items():
                        before = draft_counts(url)
                        text, n, rate = stream(url, prompt, extra | guide, a.tokens)
                        time.sleep(0.3)  # the worker publishes its stats after the step that finished the request
                        after = draft_counts(url)
                        row = rows.setdefault((w, s, name), {"rates": [], "texts": [], "counts": [0, 0, 0]})
                        row["rates"].append(rate)
                        row["texts"].append(text)
                        row["counts"] = [c + x - y for c, x, y in zip(row["counts"], after, before)]
        conc = {}
        for c in [int(x) for x in a.concurrency.split(",") if x]:
            for rep in range(a.reps):
                for name, url in urls.items():
                    jobs = list(workloads.values())
                    t0 = time.perf_counter()
                    with concurrent.futures.ThreadPoolExecutor(c) as ex:
                        futs = [ex.submit(stream, url, jobs[i % len(jobs)][0], SAMPLINGS["greedy"] | jobs[i % len(jobs)][1],
                                          a.tokens) for i in range(c)]
                        total = sum(f.result()[1] for f in futs)
                    conc.setdefault((c, name), []).append(total / (time.perf_counter() - t0))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)

    print(f"{a.tokens}-token chats (ignore_eos), {a.reps} rounds, servers interleaved request by request")
    print("| workload | sampling | server | median decode tok/s | ratio to off | drafts per token | "
          "mean draft | accepted | same answers |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    report = {"tokens": a.tokens, "reps": a.reps, "single": [], "concurrent": []}
    for w in workloads:
        for s in SAMPLINGS:
            base = statistics.median(rows[(w, s, "off")]["rates"])
            for name in urls:
                r = rows[(w, s, name)]
                med = statistics.median(r["rates"])
                drafts, drafted, accepted = r["counts"]
                per_token = drafts / (a.tokens * a.reps)
                mean = f"{drafted / drafts:.2f}" if drafts else "-"
                rate = f"{accepted / drafted:.0%}" if drafted else "-"
                same = "yes" if r["texts"] == rows[(w, s, "off")]["texts"] else "NO"
                print(f"| {w} | {s} | {name} | {med:.1f} | {med / base:.2f} | {per_token:.2f} | {mean} | {rate} "
                      f"| {same} |")
                report["single"].append({"workload": w, "sampling": s, "server": name, "rates": r["rates"],
                                         "drafts": drafts, "draft_tokens": drafted, "accepted": accepted,
                                         "same": same == "yes"})
    if conc:
        print()
        print("| concurrent streams | server | median generated tok/s (all streams) | ratio to off |")
        print("|---:|---|---:|---:|")
        for (c, name), v in conc.items():
            base = statistics.median(conc[(c, "off")])
            print(f"| {c} | {name} | {statistics.median(v):.1f} | {statistics.median(v) / base:.2f} |")
            report["concurrent"].append({"streams": c, "server": name, "rates": v})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
