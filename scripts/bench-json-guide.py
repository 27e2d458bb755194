#!/usr/bin/env python3
"""What guided decoding (`response_format` `json_object` and `json_schema`, and vLLM's `guided_regex` and
`structured_outputs.grammar`) costs, measured through a running `pagoda up`.

96-token chats with `ignore_eos` (so every mode generates the same count), greedy and sampled, plain and guided by
each format, interleaved; prints each mode's median tokens/s and its ratio to plain greedy. The schema has a long
array of strings, so that the answer stays inside it for most of the 96 tokens. The pattern is prose-like text
(letters, digits, spaces and punctuation, any length); it needs a stop token besides the ignored EOS, and token
49,151, the vocabulary's last, is one the model does not pick here. Two grammars: the pattern's own language
(`root ::= [...]+`, so the Earley guide runs beside the DFA on the same text), and JSON values separated by commas
with no end (nested objects, arrays and strings: a context-free language), both with that stop token.

    scripts/bench-json-guide.py [--url http://127.0.0.1:8080] [--reps 7] [--tokens 96] [--modes regex,grammar]
"""

import argparse
import json
import pathlib
import statistics
import time
import urllib.request

MODEL = "SmolLM2-135M-Instruct.Q4_1"
GUIDED = {"response_format": {"type": "json_object"}}
SCHEMA = {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": {
    "type": "object", "additionalProperties": False, "required": ["city", "country", "population", "facts"],
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"},
                   "facts": {"type": "array", "items": {"type": "string"}, "maxItems": 50}}}}}}
REGEX = {"guided_regex": "[A-Za-z0-9 ,.;:'\\n-]+", "stop_token_ids": [49151]}
GRAMMAR_TEXT = {"structured_outputs": {"grammar": "root ::= [A-Za-z0-9 ,.;:'\\n-]+"}, "stop_token_ids": [49151]}
JSON_VALUES = (pathlib.Path(__file__).parent / "grammars" / "json-values.gbnf").read_text()
GRAMMAR_JSON = {"structured_outputs": {"grammar": JSON_VALUES}, "stop_token_ids": [49151]}
SAMPLED = {"temperature": 0.8, "seed": 1}


def run(url, tokens, extra):
    body = {"model": MODEL, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Describe a city as a JSON object with many fields."}], **extra}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.load(r)
    assert out["usage"]["completion_tokens"] == tokens, out["usage"]
    return tokens / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--modes", default="", help="comma-separated guides to run beside plain (json_object, "
                    "json_schema, regex, grammar); all by default")
    a = ap.parse_args()
    modes = {"plain, greedy": {}, "json_object, greedy": GUIDED, "json_schema, greedy": SCHEMA,
             "regex, greedy": REGEX, "grammar (the regex's language), greedy": GRAMMAR_TEXT,
             "grammar (JSON values), greedy": GRAMMAR_JSON,
             "plain, temperature 0.8": SAMPLED, "json_object, temperature 0.8": GUIDED | SAMPLED,
             "json_schema, temperature 0.8": SCHEMA | SAMPLED, "regex, temperature 0.8": REGEX | SAMPLED,
             "grammar (the regex's language), temperature 0.8": GRAMMAR_TEXT | SAMPLED,
             "grammar (JSON values), temperature 0.8": GRAMMAR_JSON | SAMPLED}
    if a.modes:
        modes = {m: v for m, v in modes.items() if m.startswith("plain") or any(k in m for k in a.modes.split(","))}
    runs = {m: [] for m in modes}
    for _ in range(a.reps):
        for m, extra in modes.items():
            runs[m].append(run(a.url, a.tokens, extra))
    base = statistics.median(runs["plain, greedy"])
    print(f"{a.tokens}-token chats, {a.reps} runs each, interleaved")
    print("| mode | median generated tokens/s | ratio to plain greedy |")
    print("|---|---:|---:|")
    for m, v in runs.items():
        print(f"| {m} | {statistics.median(v):.1f} | {statistics.median(v) / base:.3f} |")


if __name__ == "__main__":
    main()
