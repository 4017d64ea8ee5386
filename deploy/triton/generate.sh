#!/usr/bin/env sh
# Regenerate the model configurations kept in git (tests check they match the generator).
# Without --config-only the same commands also place the ONNX files, ready to serve.
set -eu
cd "$(dirname "$0")/../.."
GATEWAY=${GATEWAY:-.venv/bin/gateway}
$GATEWAY models triton-repo --all --config-only --out deploy/triton/tensorrt --variant tensorrt --triton-instances 2 "$@"
$GATEWAY models triton-repo --all --config-only --out deploy/triton/onnxruntime --variant onnxruntime --triton-instances 2 "$@"
$GATEWAY models triton-repo --all --config-only --out deploy/triton/openvino --variant openvino --triton-instances 2 "$@"
$GATEWAY models triton-repo --all --config-only --out deploy/triton/python --variant python "$@"
