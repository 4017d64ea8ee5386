from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np

from loadtests.harness.dataset import SMALLEST, build


def test_dataset_is_reproducible_224px_with_identical_copies(tmp_path: Path) -> None:
    first = build(tmp_path / "a", count=12, copies=3, seed=7)
    second = build(tmp_path / "b", count=12, copies=3, seed=7)
    other = build(tmp_path / "c", count=12, copies=1, seed=8)
    assert len(first.originals) == 12
    assert len(first.files) == 36
    assert [p.read_bytes() for p in first.files] == [p.read_bytes() for p in second.files]  # same seed, same bytes
    assert first.originals[0].read_bytes() != other.originals[0].read_bytes()
    assert len({p.read_bytes() for p in first.originals}) == 12  # distinct photos
    for path in first.originals:
        image = cv2.imdecode(np.frombuffer(path.read_bytes(), np.uint8), cv2.IMREAD_COLOR)
        assert image.shape == (224, 224, 3)
        assert path.stat().st_size >= SMALLEST
    copy = first.folder / "copy-2" / first.originals[5].name
    assert copy.read_bytes() == first.originals[5].read_bytes()
    manifest = json.loads((first.folder / "manifest.json").read_text())
    assert (manifest["count"], manifest["copies"], len(manifest["files"])) == (12, 3, 36)


def test_dataset_from_your_own_photos(tmp_path: Path) -> None:
    source = tmp_path / "mine"
    source.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        cv2.imwrite(str(source / f"{i}.png"), rng.integers(0, 256, (300, 400, 3), dtype=np.uint8))
    (source / "notes.txt").write_text("not a photo")
    dataset = build(tmp_path / "out", count=4, source=source)
    assert len(dataset.files) == 4
