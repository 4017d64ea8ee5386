"""Real photos for benchmarks: scikit-image's sample photos, or a folder the user gives; and
noise, for bodies that do not compress."""

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


def noise_png(side: int = 512, seed: int = 0) -> bytes:
    """An incompressible PNG (~770 KB at 512 px): large bodies make unbounded buffering visible."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return cv2.imencode(".png", pixels)[1].tobytes()
