#!/usr/bin/env bash
# Classify photos with curl: an upload, a raw body, and (if the gateway fetches URLs) an image by URL.
#   examples/classify.sh PHOTO [GATEWAY]          GATEWAY defaults to http://127.0.0.1:8000
# With API keys set on the gateway, export GATEWAY_API_KEY too.
set -euo pipefail
photo=${1:?usage: examples/classify.sh PHOTO [GATEWAY]}
gateway=${2:-http://127.0.0.1:8000}
auth=()
[ -n "${GATEWAY_API_KEY:-}" ] && auth=(-H "Authorization: Bearer $GATEWAY_API_KEY")

# 1. A multipart upload (several -F file=@... send several images in one request).
curl -sS --fail-with-body "${auth[@]}" -F "file=@$photo" "$gateway/classify?top_k=3"
echo
# 2. The image as the raw body, with its media type.
curl -sS --fail-with-body "${auth[@]}" -H "Content-Type: image/jpeg" --data-binary "@$photo" "$gateway/classify?top_k=1"
echo
