#!/usr/bin/env bash
# Classify a folder of photos through RabbitMQ (offline mode) into JSON lines.
#   GATEWAY_BROKER_URL=amqp://guest:guest@127.0.0.1:5672/ examples/ingest_folder.sh FOLDER RESULTS.jsonl
# Needs RabbitMQ and the gateway installed (scripts/bootstrap; the checkout's .venv is found without
# activating it). Starts a worker (unless WORKER=no: then one must already consume the queues), ingests every image
# under FOLDER, and prints how many ended done or failed. Re-running resumes: images already in
# RESULTS.jsonl are not sent again.
set -euo pipefail
folder=${1:?usage: examples/ingest_folder.sh FOLDER RESULTS.jsonl}
out=${2:?usage: examples/ingest_folder.sh FOLDER RESULTS.jsonl}
: "${GATEWAY_BROKER_URL:?set GATEWAY_BROKER_URL (e.g. amqp://guest:guest@127.0.0.1:5672/)}"
# the gateway command: GATEWAY_COMMAND (words, e.g. "docker compose run --rm gateway"), else
# `gateway` on the PATH, else this checkout's .venv (its path may have spaces)
if [ -n "${GATEWAY_COMMAND:-}" ]; then
  read -ra gateway <<<"$GATEWAY_COMMAND"
elif command -v gateway >/dev/null; then
  gateway=(gateway)
elif [ -x "$(dirname "$0")/../.venv/bin/gateway" ]; then
  gateway=("$(dirname "$0")/../.venv/bin/gateway")
else
  echo "ingest_folder.sh: no gateway command: run scripts/bootstrap (or activate its .venv), or set GATEWAY_COMMAND" >&2
  exit 2
fi
worker=
if [ "${WORKER:-yes}" != no ]; then
  "${gateway[@]}" worker &
  worker=$!
  trap 'kill -TERM $worker 2>/dev/null; wait $worker 2>/dev/null || true' EXIT
fi
"${gateway[@]}" ingest "$folder" --out "$out"
echo "done: $(grep -c '"status": *"done"' "$out" || true), failed: $(grep -c '"status": *"failed"' "$out" || true)"
