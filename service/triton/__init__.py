"""Triton Inference Server: model repositories the gateway can use, and a local server launcher."""
