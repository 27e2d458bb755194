"""Helpers the benchmark scripts share for the `pagoda up` servers they start."""

import json
import subprocess
import sys
import tempfile
import time
import urllib.request


def start_up(binary, port, flags, log_name):
    """Starts `pagoda up` on 127.0.0.1:`port` with `flags`, its output in /tmp/`log_name`-`port`.log."""
    log = open(f"/tmp/{log_name}-{port}.log", "w")
    return subprocess.Popen([binary, "up", "--listen", f"127.0.0.1:{port}", *flags], stdout=log,
                            stderr=subprocess.STDOUT)


def bench_load(binary, url, flags):
    """Runs `pagoda bench load --router url` with `flags` and returns its JSON summary; exits if it fails (a lost
    request or an answer that differs from the greedy reference fails it)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [binary, "bench", "load", "--router", url, *flags, "--json", out.name]
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr}")
        with open(out.name) as f:
            return json.load(f)


def wait_ready(url, proc, timeout=180):
    """Waits until the server at `url` answers `/readyz` with 200; exits if `proc` (None: started elsewhere) dies or
    `timeout` passes."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            sys.exit(f"server on {url} exited with {proc.returncode}")
        try:
            # The servers are on loopback: no proxy from the environment.
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url + "/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit(f"server on {url} not ready after {timeout}s")


def start_servers(binary, base_port, servers, common, log_name):
    """Starts one `pagoda up` per entry of `servers` (name -> its own flags, after the shared `common`) on ports from
    `base_port` on, and waits until all are ready. Returns ({name: url}, [process]); stop them with `stop_servers`,
    also when this raises."""
    procs, urls = [], {}
    try:
        for i, (name, flags) in enumerate(servers.items()):
            port = base_port + i
            urls[name] = f"http://127.0.0.1:{port}"
            procs.append(start_up(binary, port, [*common, *flags], log_name))
        for url, p in zip(urls.values(), procs):
            wait_ready(url, p)
    except BaseException:
        stop_servers(procs)
        raise
    return urls, procs


def stop_servers(procs):
    """Terminates the servers `start_servers` started and waits for them."""
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=30)


def alternating(reps, names):
    """(round, name) for `reps` rounds over `names`, every other round in reverse order, so that neither side of a
    comparison always runs first."""
    for rep in range(reps):
        for name in (names if rep % 2 == 0 else list(reversed(names))):
            yield rep, name
