#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs system packages and Python tools it needs, fetches the model,
# then checks formatting and lints and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v protoc >/dev/null || missing+=(protobuf-compiler)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

scripts/fetch-model.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace
