"""A declared model's arithmetic in NumPy, for a model in the user's Triton that takes its own
element type and layout: its input made from the uint8 RGB NHWC batch the gateway decodes, and its
output turned into the gateway's float32 rows.

The same numbers as the derived ONNX graph (``service.models.wrap``): the channel swap and the
transpose on uint8 (views, no copy), then ``x * (scale / std) + (-mean / std)`` in float32, folded
as the graph folds it, and a cast to float16 last for a float16 model. After the model: a
``[N, D, 1, 1]`` head flattened, a cast to float32, and the softmax (``logits``) or sigmoid
(``sigmoid``) the declaration asks for. Pure functions: the backend calls them off the event loop.
"""

from __future__ import annotations

import numpy as np

from service.models.declaration import Arithmetic
from service.models.profiles import OutputKind


def folded(arithmetic: Arithmetic) -> tuple[np.ndarray, np.ndarray]:
    """``scale / std`` and ``-mean / std`` per channel, in float32 (computed in float64, as the
    derived graph's constants are)."""
    std = np.asarray(arithmetic.std, np.float64)
    factor = (arithmetic.scale / std).astype(np.float32)
    offset = (-np.asarray(arithmetic.mean, np.float64) / std).astype(np.float32)
    return factor, offset


def model_input(batch: np.ndarray, arithmetic: Arithmetic) -> np.ndarray:
    """What the model takes for ``batch`` (uint8 RGB ``[N, H, W, 3]``): a new contiguous array in
    its colour order, layout and element type."""
    if batch.dtype != np.uint8 or batch.ndim != 4 or batch.shape[3] != 3:
        raise ValueError(f"expected uint8 [N, H, W, 3] images, got {batch.dtype} {list(batch.shape)}")
    x = batch[..., ::-1] if arithmetic.color == "BGR" else batch
    if arithmetic.layout == "NCHW":
        x = x.transpose(0, 3, 1, 2)
    if arithmetic.dtype == "uint8":
        return np.ascontiguousarray(x)
    per_channel = (1, 3, 1, 1) if arithmetic.layout == "NCHW" else (3,)
    factor, offset = folded(arithmetic)
    out = np.empty(x.shape, np.float32)
    if np.any(factor != 1):
        np.multiply(x, factor.reshape(per_channel), out=out)
    else:
        out[...] = x
    if np.any(offset != 0):
        np.add(out, offset.reshape(per_channel), out=out)
    return out.astype(np.float16) if arithmetic.dtype == "float16" else out


def rows(output: np.ndarray, kind: OutputKind, width: int) -> np.ndarray:
    """The model's output as the gateway's float32 ``[N, width]`` rows, with the declared head
    applied; ValueError if it is not ``N`` rows of ``width`` numbers."""
    n = output.shape[0] if output.ndim else 0
    if output.ndim not in (2, 4) or output.size != n * width or (output.ndim == 4 and output.shape[2:] != (1, 1)):
        raise ValueError(f"expected [N, {width}] (or [N, {width}, 1, 1]) scores, got {list(output.shape)}")
    if output.dtype.kind != "f":
        raise ValueError(f"expected floating-point scores, got {output.dtype}")
    x = output.reshape(n, width).astype(np.float32, copy=False)
    if kind == "logits":
        e: np.ndarray = np.exp(x - x.max(axis=1, keepdims=True))
        e /= e.sum(axis=1, keepdims=True)
        return e
    if kind == "sigmoid":
        s: np.ndarray = np.tanh(0.5 * x)
        s += 1.0
        s *= 0.5
        return s
    return np.ascontiguousarray(x)
