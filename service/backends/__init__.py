"""Inference backends: where a batch of uint8 NHWC images becomes a batch of class scores."""

from service.backends.base import Backend

__all__ = ["Backend"]
