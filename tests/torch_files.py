"""Write PyTorch checkpoints in both on-disk formats without torch, for testing the reader.

The pickles name ``torch.FloatStorage`` and ``torch._utils._rebuild_tensor_v2`` exactly as torch
writes them: stand-ins registered under those module names while pickling.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import sys
import types
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

_STORAGE_NAMES = {np.dtype("float32"): "FloatStorage", np.dtype("int64"): "LongStorage"}


class _Storage:
    def __init__(self, key: str, data: np.ndarray) -> None:
        self.key = key
        self.data = np.ascontiguousarray(data).reshape(-1)


class _Tensor:
    def __init__(self, storage: _Storage, offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.args = (storage, offset, shape, stride)

    def __reduce__(self) -> tuple[Any, ...]:
        torch_utils = sys.modules["torch._utils"]
        return (torch_utils._rebuild_tensor_v2, (*self.args, False, collections.OrderedDict()))


@contextmanager
def _fake_torch() -> Iterator[types.ModuleType]:
    torch = types.ModuleType("torch")
    utils = types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*args: Any) -> None:
        raise AssertionError("only for pickling")

    _rebuild_tensor_v2.__module__ = "torch._utils"
    _rebuild_tensor_v2.__qualname__ = "_rebuild_tensor_v2"
    utils._rebuild_tensor_v2 = _rebuild_tensor_v2  # type: ignore[attr-defined]
    for name in _STORAGE_NAMES.values():
        setattr(torch, name, type(name, (), {"__module__": "torch"}))
    torch._utils = utils  # type: ignore[attr-defined]
    saved = {k: sys.modules.get(k) for k in ("torch", "torch._utils")}
    sys.modules["torch"], sys.modules["torch._utils"] = torch, utils
    try:
        yield torch
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _tensors(state: dict[str, Any]) -> tuple[collections.OrderedDict[str, _Tensor], list[_Storage]]:
    """Each value is an array, or (storage array, offset, shape, stride) to write a strided view."""
    out: collections.OrderedDict[str, _Tensor] = collections.OrderedDict()
    storages: list[_Storage] = []
    for name, value in state.items():
        if isinstance(value, tuple):
            base, offset, shape, stride = value
        else:
            base, offset, shape = value, 0, value.shape
            stride = tuple(s // value.itemsize for s in np.ascontiguousarray(value).strides)
        storage = _Storage(str(len(storages)), base)
        storages.append(storage)
        out[name] = _Tensor(storage, offset, tuple(shape), tuple(stride))
    return out, storages


def _pickle_object(obj: Any, torch: types.ModuleType) -> bytes:
    buffer = io.BytesIO()

    class Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, _Storage):
                storage_type = getattr(torch, _STORAGE_NAMES[o.data.dtype])
                return ("storage", storage_type, o.key, "cpu", o.data.size)
            return None

    Pickler(buffer, protocol=2).dump(obj)
    return buffer.getvalue()


def write_legacy(path: Path, state: dict[str, Any]) -> None:
    obj, storages = _tensors(state)
    with _fake_torch() as torch:
        body = _pickle_object(obj, torch)
    with path.open("wb") as f:
        pickle.dump(0x1950A86A20F9469CFC6C, f, protocol=2)
        pickle.dump(1001, f, protocol=2)
        pickle.dump({"protocol_version": 1001, "little_endian": True, "type_sizes": {}}, f, protocol=2)
        f.write(body)
        pickle.dump([s.key for s in storages], f, protocol=2)
        for s in storages:
            f.write(struct.pack("<q", s.data.size))
            f.write(s.data.tobytes())


def write_zip(path: Path, state: dict[str, Any]) -> None:
    obj, storages = _tensors(state)
    with _fake_torch() as torch:
        body = _pickle_object(obj, torch)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", body)
        archive.writestr("archive/version", "3\n")
        for s in storages:
            archive.writestr(f"archive/data/{s.key}", s.data.tobytes())
