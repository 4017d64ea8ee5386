"""Read PyTorch ``state_dict`` checkpoints into numpy arrays, without torch.

Two on-disk formats exist:

* the legacy format (torch < 1.6): five pickles in a row (magic number, protocol version, system
  info, the object, the list of storage keys) followed by each storage's raw bytes, each preceded by
  its element count as a little-endian int64;
* the zip format (torch >= 1.6): ``<root>/data.pkl`` holds the object and ``<root>/data/<key>`` each
  storage's raw bytes.

In both, the object pickle refers to storages through persistent ids and rebuilds tensors with
``torch._utils._rebuild_tensor_v2``. A restricted unpickler resolves only the handful of globals a
state_dict needs, so a checkpoint cannot run arbitrary code, and nothing in the file is trusted:
every storage's size is checked against the file and ``MAX_STORAGE_BYTES`` before it is read, and
every tensor's offset, shape and strides against its storage before a view is made (a crafted
file could otherwise hand back heap memory as weights).
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

MAX_STORAGE_BYTES = 4 * 1024**3
"""Largest storage read (ResNet-50's largest is 8 MB; a whole ViT-H checkpoint is 2.5 GB)."""
MAX_PICKLE_BYTES = 64 * 1024**2

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001

_STORAGE_DTYPES: dict[str, np.dtype[Any]] = {
    "FloatStorage": np.dtype("<f4"),
    "DoubleStorage": np.dtype("<f8"),
    "HalfStorage": np.dtype("<f2"),
    "LongStorage": np.dtype("<i8"),
    "IntStorage": np.dtype("<i4"),
    "ShortStorage": np.dtype("<i2"),
    "CharStorage": np.dtype("i1"),
    "ByteStorage": np.dtype("u1"),
    "BoolStorage": np.dtype("?"),
}


class CheckpointError(ValueError):
    """The file is not a state_dict checkpoint this reader understands."""


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: np.dtype[Any]


@dataclass(frozen=True)
class _TensorRef:
    storage: _StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class _StorageType:
    dtype: np.dtype[Any]


def _ints(values: Any, what: str) -> tuple[int, ...]:
    if not isinstance(values, tuple | list) or not all(type(v) is int for v in values):
        raise CheckpointError(f"tensor {what} {values!r} is not a tuple of integers")
    return tuple(values)


def _rebuild_tensor_v2(storage: _StorageRef, offset: Any, size: Any, stride: Any, *_: Any) -> _TensorRef:
    if not isinstance(storage, _StorageRef) or type(offset) is not int:
        raise CheckpointError("malformed tensor record")
    return _TensorRef(storage, offset, _ints(size, "shape"), _ints(stride, "strides"))


def _rebuild_parameter(data: _TensorRef, *_: Any) -> _TensorRef:
    return data


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "torch._utils" and name == "_rebuild_parameter":
            return _rebuild_parameter
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        raise CheckpointError(f"checkpoint refers to {module}.{name}, which a state_dict never needs")

    def persistent_load(self, pid: Any) -> _StorageRef:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise CheckpointError(f"unexpected persistent id {pid!r}")
        storage_type, key = pid[1], str(pid[2])
        if not isinstance(storage_type, _StorageType):
            raise CheckpointError(f"unexpected storage type {storage_type!r}")
        return _StorageRef(key, storage_type.dtype)


def _load_pickle(stream: IO[bytes]) -> Any:
    return _Unpickler(stream).load()


def _materialise(obj: Any, storages: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    if not isinstance(obj, dict):
        raise CheckpointError(f"checkpoint holds a {type(obj).__name__}, not a state_dict")
    if "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    out: dict[str, np.ndarray] = {}
    for name, ref in obj.items():
        if not isinstance(ref, _TensorRef):
            continue  # e.g. BatchNorm's num_batches_tracked is a tensor too; other values are skipped
        flat = storages.get(ref.storage.key)
        if flat is None:
            raise CheckpointError(f"{name}: refers to storage {ref.storage.key!r}, which the file does not hold")
        _check_view(str(name), ref, len(flat))
        itemsize = flat.dtype.itemsize
        view = np.lib.stride_tricks.as_strided(
            flat[ref.offset :],
            shape=ref.shape,
            strides=tuple(s * itemsize for s in ref.stride),
            writeable=False,
        )
        out[str(name)] = np.ascontiguousarray(view)
    return out


def _check_view(name: str, ref: _TensorRef, length: int) -> None:
    """The view must lie inside its storage: offset, shape and strides non-negative, and the last
    element it reaches before the storage's end."""
    if len(ref.shape) != len(ref.stride):
        raise CheckpointError(f"{name}: shape {ref.shape} and strides {ref.stride} differ in length")
    if ref.offset < 0 or any(d < 0 for d in ref.shape) or any(s < 0 for s in ref.stride):
        raise CheckpointError(f"{name}: negative offset, size or stride")
    if 0 in ref.shape:
        return
    last = ref.offset + sum((d - 1) * s for d, s in zip(ref.shape, ref.stride, strict=True))
    if last >= length:
        raise CheckpointError(
            f"{name}: offset {ref.offset}, shape {ref.shape} and strides {ref.stride} reach element {last} "
            f"of a storage of {length}"
        )


def _storage_bytes(count: int, itemsize: int, available: int, key: str) -> int:
    size = count * itemsize
    if count < 0 or size > MAX_STORAGE_BYTES or size > available:
        raise CheckpointError(
            f"storage {key!r} claims {count} elements ({size} bytes); the file has {available} bytes left "
            f"and the limit is {MAX_STORAGE_BYTES} (truncated or crafted checkpoint)"
        )
    return size


def _read_legacy(stream: IO[bytes]) -> dict[str, np.ndarray]:
    if _load_pickle(stream) != LEGACY_MAGIC:
        raise CheckpointError("not a PyTorch checkpoint (bad magic number)")
    if _load_pickle(stream) != LEGACY_PROTOCOL:
        raise CheckpointError("unsupported legacy protocol version")
    sys_info = _load_pickle(stream)
    if not sys_info.get("little_endian", True):
        raise CheckpointError("big-endian checkpoints are not supported")
    refs: list[_StorageRef] = []

    class Collecting(_Unpickler):
        def persistent_load(self, pid: Any) -> _StorageRef:
            ref = super().persistent_load(pid)
            refs.append(ref)
            return ref

    obj = Collecting(stream).load()
    keys = [str(k) for k in _load_pickle(stream)]
    dtypes = {r.key: r.dtype for r in refs}
    storages: dict[str, np.ndarray] = {}
    position = stream.tell()
    end = stream.seek(0, io.SEEK_END)
    stream.seek(position)
    for key in keys:
        if key not in dtypes:
            raise CheckpointError(f"storage {key!r} is listed but no tensor uses it")
        raw_count = stream.read(8)
        if len(raw_count) != 8:
            raise CheckpointError("checkpoint is truncated")
        (count,) = struct.unpack("<q", raw_count)
        dtype = dtypes[key]
        size = _storage_bytes(count, dtype.itemsize, end - stream.tell(), key)
        raw = stream.read(size)
        if len(raw) != size:
            raise CheckpointError("checkpoint is truncated")
        storages[key] = np.frombuffer(raw, dtype=dtype)
    return _materialise(obj, storages)


def _read_zip(path: Path) -> dict[str, np.ndarray]:
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        pkl = next((n for n in names if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None:
            raise CheckpointError("zip checkpoint has no data.pkl")
        root = pkl[: -len("data.pkl")]
        refs: dict[str, _StorageRef] = {}

        class Collecting(_Unpickler):
            def persistent_load(self, pid: Any) -> _StorageRef:
                ref = super().persistent_load(pid)
                refs[ref.key] = ref
                return ref

        if archive.getinfo(pkl).file_size > MAX_PICKLE_BYTES:
            raise CheckpointError(f"data.pkl is over {MAX_PICKLE_BYTES} bytes")
        obj = Collecting(io.BytesIO(archive.read(pkl))).load()
        storages = {}
        for key, ref in refs.items():
            try:
                info = archive.getinfo(f"{root}data/{key}")
            except KeyError:
                raise CheckpointError(f"storage {key!r} is missing from the archive") from None
            if info.file_size > MAX_STORAGE_BYTES or info.file_size % ref.dtype.itemsize:
                raise CheckpointError(
                    f"storage {key!r} is {info.file_size} bytes: over {MAX_STORAGE_BYTES} or not whole "
                    f"{ref.dtype} elements"
                )
            storages[key] = np.frombuffer(archive.read(info), dtype=ref.dtype)
    return _materialise(obj, storages)


def read_state_dict(path: Path) -> dict[str, np.ndarray]:
    """Return the checkpoint's tensors by parameter name, as contiguous numpy arrays."""
    if zipfile.is_zipfile(path):
        return _read_zip(path)
    with path.open("rb") as stream:
        return _read_legacy(stream)
