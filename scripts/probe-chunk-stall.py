#!/usr/bin/env python3
"""What a decoding stream waits while long prompts are prefilled beside it on one worker (chunked prefill).

Starts `pagoda up --threads 1`, streams one greedy answer of `--stream-tokens` tokens, and one second in sends
`--prompts` chat prompts of `--words` words each (unique, one output token). Prints when each prompt finished and
every gap over 100 ms between the stream's deltas: each is one engine step that ran a prompt chunk
(`--max-step-tokens`, 512 by default) beside the stream's decode. docs/BENCHMARKS.md ("Disaggregated serving")
quotes it.

    scripts/probe-chunk-stall.py [--bin target/release/pagoda] [--port 18601] [--prompts 2] [--words 2000]
"""

import argparse
import http.client
import json
import random
import threading
import time

from pagoda_servers import start_up, wait_ready

WORDS = "river mountain garden window station library kitchen market island forest".split()


def chat(port, content, max_tokens, stream, out):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    if not stream:
        r.read()
        out.append(time.time())
        return
    while True:
        line = r.readline()
        if not line:
            break
        if line.startswith(b"data: ") and b"content" in line:
            out.append(time.time())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/pagoda")
    ap.add_argument("--port", type=int, default=18601)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--words", type=int, default=2000)
    ap.add_argument("--stream-tokens", type=int, default=400)
    a = ap.parse_args()
    url = f"http://127.0.0.1:{a.port}"
    server = start_up(a.bin, a.port, ["--threads", "1"], "probe-chunk-stall")
    try:
        wait_ready(url, server)
        deltas = []
        stream = threading.Thread(target=chat, args=(a.port, "Tell me a long story about a cat.", a.stream_tokens,
                                                     True, deltas))
        stream.start()
        time.sleep(1.0)
        done, threads = [], []
        for i in range(a.prompts):
            rng = random.Random(i)
            text = f"Request {i}. Summarise: " + " ".join(rng.choice(WORDS) for _ in range(a.words))
            out = []
            done.append(out)
            t = threading.Thread(target=chat, args=(a.port, text, 1, False, out))
            t.start()
            threads.append(t)
        for t in threads + [stream]:
            t.join()
    finally:
        server.terminate()
        server.wait(timeout=30)
    t0 = deltas[0]
    print("prompts finished at", [round(o[0] - t0, 2) for o in done], "s after the stream's first delta")
    for prev, t in zip(deltas, deltas[1:]):
        if t - prev > 0.1:
            print(f"gap {t - prev:.3f} s ending at {t - t0:.3f} s")


if __name__ == "__main__":
    main()
