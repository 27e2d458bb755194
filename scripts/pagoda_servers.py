"""Helpers the benchmark scripts share for the `pagoda up` servers they start."""

import sys
import time
import urllib.request


def wait_ready(url, proc, timeout=180):
    """Waits until the server at `url` answers `/readyz` with 200; exits if `proc` dies or `timeout` passes."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server on {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit(f"server on {url} not ready after {timeout}s")
