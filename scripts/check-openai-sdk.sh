#!/usr/bin/env bash
# The official OpenAI Python SDK against a real `pagoda up` (the embedded cluster on the real model): chat
# completions (plain and streamed), completions, the Responses API (plain, streamed, structured, a function call,
# continued with previous_response_id, retrieved and deleted) and the SDK's error classes. The SDK parses every answer into its
# own types, so a shape it cannot read fails here (scripts/openai_sdk_check.py).
#   1. pip-installs the pinned `openai` package into a venv under target/;
#   2. starts `pagoda up` on a free loopback port, waits for /readyz;
#   3. runs the checks, then stops the server.
# Usage: bash scripts/check-openai-sdk.sh   (env PAGODA_BIN: the pagoda binary; default target/debug/pagoda)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

venv="$root/target/openai-sdk-venv"
# shellcheck source=scripts/venv.sh
. scripts/venv.sh
pinned_venv "$venv" "openai==3.51.0" check-openai-sdk

pagoda="${PAGODA_BIN:-$root/target/debug/pagoda}"
model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
log=$(mktemp)
"$pagoda" up --listen 127.0.0.1:0 --model "$model" --threads 2 > "$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -f "$log"' EXIT

url=""
for _ in $(seq 1 240); do
  url=$(sed -n 's/.*pagoda router listening on \(http:\/\/[0-9.:]*\).*/\1/p' "$log" | head -n 1)
  [ -n "$url" ] && break
  kill -0 "$server" 2>/dev/null || { cat "$log"; echo "check-openai-sdk: pagoda up exited"; exit 1; }
  sleep 0.5
done
[ -n "$url" ] || { cat "$log"; echo "check-openai-sdk: no router address in the log"; exit 1; }
echo "check-openai-sdk: $url"
"$venv/bin/python" scripts/openai_sdk_check.py "$url"
