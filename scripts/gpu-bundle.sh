#!/usr/bin/env bash
# Builds what a lent GPU machine runs, here, into target/gpu-bundle/ (ignored by git). The device machine has CUDA,
# its libraries in the image's Python wheels and no Rust toolchain, and nothing can be fetched there, so the
# binaries travel with the call (`carry`, at most 64 MiB per call):
#   target/gpu-bundle/bin.tar.xz   pagoda (release, --features cuda) and the cuda_parity and cuda_model test
#                                  binaries, stripped;
#   target/gpu-bundle/model.partN  the SmolLM2 GGUF, xz-compressed, in two parts (42 MB, 50 MB): the working tree
#                                  (about 11 MB) travels with every call, so the model takes two calls.
# Then, on the device machine, scripts/gpu-run.sh STAGE (see there), one call per stage. A warm machine keeps what
# earlier calls brought, so each call carries only what is new, by path:
#   1. carry bin.tar.xz, model.sha256, model.part0; run `gpu-run.sh parity kernels`
#   2. carry model.part1; run `gpu-run.sh model smollm2 peers engine eviction` (the model joins once both parts
#      are there)
# Usage: bash scripts/gpu-bundle.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/gpu-bundle
rm -rf "$out"
mkdir -p "$out/stage"

echo "gpu-bundle: cargo build --release --features cuda (pagoda, cuda_parity, cuda_model)"
cargo build --quiet --release -p pagoda --features cuda
cp target/release/pagoda "$out/stage/pagoda"
test_bin() {
  # The test executable cargo built for `$1 --test $2` (cargo prints its path as JSON).
  cargo test --quiet --release --features cuda --no-run -p "$1" --test "$2" --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$2" | tail -n1
}
for t in "pagoda-kernels cuda_parity" "pagoda-worker cuda_model"; do
  # shellcheck disable=SC2086
  set -- $t
  exe=$(test_bin "$1" "$2")
  [ -x "$exe" ] || { echo "gpu-bundle: no test binary for $1 --test $2" >&2; exit 1; }
  cp "$exe" "$out/stage/$2"
done
strip "$out"/stage/*
tar -C "$out/stage" -cf - . | xz -T0 -6 > "$out/bin.tar.xz"
rm -rf "$out/stage"

model=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$model" ]; then
  # xz takes the 98 MB GGUF to about 92 MB, so two calls carry it: the first part rides with bin.tar.xz (8.5 MB)
  # and the working tree (11 MB) under the 64 MiB limit, the second with the tree alone.
  xz -T0 -3 -c "$model" > "$out/model.xz"
  head -c 40M "$out/model.xz" > "$out/model.part0"
  tail -c +$((40 * 1048576 + 1)) "$out/model.xz" > "$out/model.part1"
  rm "$out/model.xz"
  { sha256sum "$model" | cut -d' ' -f1; ls "$out"/model.part* | wc -l; } > "$out/model.sha256"
fi
ls -l "$out"
du -sh "$out"/bin.tar.xz
