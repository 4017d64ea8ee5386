#!/usr/bin/env bash
# Classify photos with curl: an upload, a raw body, and (given IMAGE_URL, to a gateway that fetches
# URLs: GATEWAY_URL_INPUTS) an image by URL.
#   examples/classify.sh PHOTO [GATEWAY [IMAGE_URL]]    GATEWAY defaults to http://127.0.0.1:8000
# With API keys set on the gateway, export GATEWAY_API_KEY too. Needs curl and a running gateway
# (scripts/serve); curl says in one line when it cannot reach it.
set -euo pipefail
usage="usage: examples/classify.sh PHOTO [GATEWAY [IMAGE_URL]]"
photo=${1:?$usage}
gateway=${2:-http://127.0.0.1:8000}
image_url=${3:-}
[ -r "$photo" ] || { echo "classify.sh: cannot read $photo" >&2; exit 2; }
auth=()
[ -n "${GATEWAY_API_KEY:-}" ] && auth=(-H "Authorization: Bearer $GATEWAY_API_KEY")

# 1. A multipart upload (several -F file=@... send several images in one request).
curl -sS --fail-with-body "${auth[@]}" -F "file=@$photo" "$gateway/classify?top_k=3"
echo
# 2. The image as the raw body, with its media type.
curl -sS --fail-with-body "${auth[@]}" -H "Content-Type: image/jpeg" --data-binary "@$photo" "$gateway/classify?top_k=1"
echo
# 3. An image by URL, for the gateway to fetch (a JSON body; the URL must not need JSON escaping).
if [ -n "$image_url" ]; then
  case "$image_url" in *'"'* | *'\'*) echo "classify.sh: IMAGE_URL must not hold \" or \\" >&2; exit 2 ;; esac
  curl -sS --fail-with-body "${auth[@]}" -H "Content-Type: application/json" \
    -d "{\"images\": [{\"url\": \"$image_url\"}]}" "$gateway/classify?top_k=1"
  echo
fi
