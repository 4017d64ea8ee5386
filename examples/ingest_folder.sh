#!/usr/bin/env bash
# Classify a folder of photos through RabbitMQ (offline mode) into JSON lines.
#   GATEWAY_BROKER_URL=amqp://guest:guest@127.0.0.1:5672/ examples/ingest_folder.sh FOLDER RESULTS.jsonl
# Starts a worker (unless WORKER=no: then one must already consume the queues), ingests every image
# under FOLDER, and prints how many ended done or failed. Re-running resumes: images already in
# RESULTS.jsonl are not sent again.
set -euo pipefail
folder=${1:?usage: examples/ingest_folder.sh FOLDER RESULTS.jsonl}
out=${2:?usage: examples/ingest_folder.sh FOLDER RESULTS.jsonl}
: "${GATEWAY_BROKER_URL:?set GATEWAY_BROKER_URL (e.g. amqp://guest:guest@127.0.0.1:5672/)}"
gateway=${GATEWAY_COMMAND:-gateway}
worker=
if [ "${WORKER:-yes}" != no ]; then
  $gateway worker &
  worker=$!
  trap 'kill -TERM $worker 2>/dev/null; wait $worker 2>/dev/null || true' EXIT
fi
$gateway ingest "$folder" --out "$out"
echo "done: $(grep -c '"status": *"done"' "$out" || true), failed: $(grep -c '"status": *"failed"' "$out" || true)"
