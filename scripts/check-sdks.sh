#!/usr/bin/env bash
# The official OpenAI and Anthropic Python SDKs against a real `pagoda up` (the embedded cluster on the real model),
# with an API keys file, so both SDKs' ways of sending a key are checked (OpenAI's `Authorization: Bearer`,
# Anthropic's `x-api-key`). OpenAI (scripts/openai_sdk_check.py): chat completions (plain and streamed),
# completions, the Responses API (plain, streamed, structured, a function call, continued with
# previous_response_id, retrieved and deleted) and the SDK's error classes. Anthropic
# (scripts/anthropic_sdk_check.py): the Messages API (plain, streamed through the SDK's stream helper, a stop
# sequence, a forced tool call and its result, count_tokens) and its error classes. Each SDK parses every answer
# into its own types, so a shape it cannot read fails here.
#   1. pip-installs the pinned `openai` and `anthropic` packages into a venv under target/;
#   2. starts `pagoda up` on a free loopback port with a keys file, waits for /readyz;
#   3. runs the checks, then stops the server.
# Usage: bash scripts/check-sdks.sh   (env PAGODA_BIN: the pagoda binary; default target/debug/pagoda)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

venv="$root/target/sdk-venv"
# shellcheck source=scripts/venv.sh
. scripts/venv.sh
pinned_venv "$venv" "openai==3.51.0 anthropic==2.10.0" check-sdks

pagoda="${PAGODA_BIN:-$root/target/debug/pagoda}"
model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
log=$(mktemp)
keys=$(mktemp)
key="sdk-check-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
echo "$key sdk-check" > "$keys"
"$pagoda" up --listen 127.0.0.1:0 --model "$model" --threads 2 --api-keys-file "$keys" > "$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -f "$log" "$keys"' EXIT

url=""
for _ in $(seq 1 240); do
  url=$(sed -n 's/.*pagoda router listening on \(http:\/\/[0-9.:]*\).*/\1/p' "$log" | head -n 1)
  [ -n "$url" ] && break
  kill -0 "$server" 2>/dev/null || { cat "$log"; echo "check-sdks: pagoda up exited"; exit 1; }
  sleep 0.5
done
[ -n "$url" ] || { cat "$log"; echo "check-sdks: no router address in the log"; exit 1; }
echo "check-sdks: $url"
PAGODA_API_KEY="$key" "$venv/bin/python" scripts/openai_sdk_check.py "$url"
PAGODA_API_KEY="$key" "$venv/bin/python" scripts/anthropic_sdk_check.py "$url"
