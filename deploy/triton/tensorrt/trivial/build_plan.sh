#!/usr/bin/env sh
# Build 1/model.plan from model.onnx with TensorRT, on the GPU that will serve it
# (a plan is specific to the GPU model and the TensorRT version). Run it inside NVIDIA's
# tritonserver or tensorrt container of the same release as the Triton that serves the plan:
#   docker run --rm --gpus all -v "$PWD":/m -w /m nvcr.io/nvidia/tensorrt:<release>-py3 sh build_plan.sh
# Input: UINT8 NHWC 224x224x3, dynamic batch 1..64, optimised for 32; FP16 kernels.
set -eu
cd "$(dirname "$0")"
mkdir -p 1
trtexec \
  --onnx=model.onnx \
  --saveEngine=1/model.plan \
  --fp16 \
  --minShapes=images:1x224x224x3 \
  --optShapes=images:32x224x224x3 \
  --maxShapes=images:64x224x224x3 \
  --memPoolSize=workspace:4096 \
  --skipInference
echo "wrote $(pwd)/1/model.plan"
