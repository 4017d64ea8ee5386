"""The tensor names every model here is built with: the wire contract between the builders, the
in-process backends and Triton's model configs. Its own module so that serving a built model needs
no ONNX tooling."""

INPUT_NAME = "images"
"""uint8 RGB images, NHWC: ``[N, H, W, 3]``."""
OUTPUT_NAME = "scores"
"""Softmax probabilities: ``[N, classes]``."""
