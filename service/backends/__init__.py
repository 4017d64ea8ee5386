"""Inference backends: where a batch of uint8 HWC images becomes a batch of class scores."""

from service.backends.base import Backend, BatchBuffer, Images

__all__ = ["Backend", "BatchBuffer", "Images"]
