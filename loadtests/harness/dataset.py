"""Build a benchmark dataset the way the study (docs/study.md) did: photos pre-resized to 224x224 (so resizing is
out of the measurement), optionally the same set copied N times (its 13,500-file set was 1,500
photos x 9), reproducible with a seed.

    python -m loadtests.harness.dataset --out data/bench --count 1500 --copies 9 [--from PHOTO_FOLDER]

Without --from, photos are generated from scikit-image's sample photos (random crops, flips,
brightness and JPEG quality), so the files are distinct real-photo content. A manifest.json lists
every file with its size and SHA-256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from loadtests.harness.photos import SAMPLE_PHOTOS
from service.images.preprocess import centre_crop_resize

SIDE = 224
SMALLEST = 2052  # the study (docs/study.md) dropped files under 2,052 bytes


@dataclass(frozen=True)
class Dataset:
    folder: Path
    originals: list[Path]
    files: list[Path]
    """Originals first, then the copies."""


def _sources(source: Path | None) -> list[np.ndarray]:
    if source is not None:
        images = []
        for path in sorted(source.iterdir()):
            image = cv2.imread(str(path), cv2.IMREAD_COLOR)
            if image is not None:
                images.append(image)
        if not images:
            raise SystemExit(f"no readable photos in {source}")
        return images
    from skimage import data

    return [np.ascontiguousarray(np.asarray(getattr(data, name)())[:, :, ::-1]) for name in SAMPLE_PHOTOS]


def _variant(image: np.ndarray, rng: random.Random) -> np.ndarray:
    h, w = image.shape[:2]
    scale = rng.uniform(0.6, 1.0)
    ch, cw = max(8, int(h * scale)), max(8, int(w * scale))
    y, x = rng.randint(0, h - ch), rng.randint(0, w - cw)
    crop = image[y : y + ch, x : x + cw]
    if rng.random() < 0.5:
        crop = cv2.flip(crop, 1)
    crop = cv2.convertScaleAbs(crop, alpha=rng.uniform(0.8, 1.2), beta=rng.uniform(-20, 20))
    return centre_crop_resize(crop, SIDE, 1.0)


def build(out: Path, *, count: int, copies: int = 1, seed: int = 0, source: Path | None = None) -> Dataset:
    """``count`` distinct 224x224 JPEGs in ``out``, plus ``copies - 1`` byte-identical copies of the set."""
    rng = random.Random(seed)
    sources = _sources(source)
    if out.exists():
        shutil.rmtree(out)
    originals_dir = out / "originals"
    originals_dir.mkdir(parents=True)
    originals: list[Path] = []
    while len(originals) < count:
        image = _variant(sources[len(originals) % len(sources)], rng)
        ok, buf = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, rng.randint(75, 95)])
        if not ok or len(buf) < SMALLEST:
            continue
        path = originals_dir / f"img-{len(originals):05d}.jpg"
        path.write_bytes(buf.tobytes())
        originals.append(path)
    files = list(originals)
    for copy in range(1, copies):
        copy_dir = out / f"copy-{copy}"
        copy_dir.mkdir()
        for path in originals:
            target = copy_dir / path.name
            shutil.copyfile(path, target)
            files.append(target)
    manifest = {
        "seed": seed,
        "count": count,
        "copies": copies,
        "side": SIDE,
        "files": [
            {
                "path": str(p.relative_to(out)),
                "bytes": p.stat().st_size,
                "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            }
            for p in files
        ],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return Dataset(out, originals, files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=1500)
    parser.add_argument(
        "--copies", type=int, default=1, help="9 gives the study's (docs/study.md) 13,500-file set from 1,500"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--from", dest="source", type=Path, default=None, help="folder of your own photos")
    args = parser.parse_args()
    dataset = build(args.out, count=args.count, copies=args.copies, seed=args.seed, source=args.source)
    print(f"{len(dataset.files)} files ({len(dataset.originals)} distinct) in {dataset.folder}")


if __name__ == "__main__":
    main()
