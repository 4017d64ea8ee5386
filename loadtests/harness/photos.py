"""Real photos for benchmarks: scikit-image's sample photos, or a folder the user gives."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

SAMPLE_PHOTOS = ("chelsea", "coffee", "astronaut", "rocket", "cat", "immunohistochemistry", "hubble_deep_field")


def sample_photos(folder: Path | None = None, *, quality: int = 90) -> list[tuple[str, bytes]]:
    """(name, JPEG bytes) for each photo, at its own size."""
    if folder is not None:
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in {".jpg", ".jpeg", ".png", ".webp"})
        if not files:
            raise SystemExit(f"no photos in {folder}")
        return [(p.name, p.read_bytes()) for p in files]
    from skimage import data

    photos = []
    for name in SAMPLE_PHOTOS:
        rgb = np.asarray(getattr(data, name)())
        ok, buf = cv2.imencode(".jpg", rgb[:, :, ::-1], [cv2.IMWRITE_JPEG_QUALITY, quality])
        assert ok
        photos.append((f"{name}.jpg", buf.tobytes()))
    return photos
