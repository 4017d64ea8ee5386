"""The decode-memory cases: images of every accepted format, bit depth and alpha, and the peak
memory of preparing one of them.

Each image is prepared in a fresh Python process (``python -m loadtests.harness.decode_cases
PATH``, which prints JSON); the figure is that process's peak RSS (``VmHWM``) less its RSS just
before ``prepare``, so the bytes already read and the imports do not count. ``estimate`` is
``service.images.preprocess.decoded_bytes``, what ``GATEWAY_MAX_IMAGE_BYTES`` is compared with.
``loadtests.decode_memory`` prints the table; ``tests/images/test_preprocess.py`` holds each case
to its budget.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from service.images.imageinfo import probe
from service.images.preprocess import PreprocessConfig, decoded_bytes, prepare


@dataclass(frozen=True)
class Case:
    name: str
    width: int
    height: int
    channels: int
    """1 grey, 3 BGR, 4 BGRA."""
    ext: str
    depth: type = np.uint8
    params: tuple[int, ...] = ()


CASES = (
    Case("png-rgba8", 7000, 7000, 4, ".png"),
    Case("png-rgb16", 5000, 5000, 3, ".png", np.uint16),
    Case("png-rgba16", 4000, 4000, 4, ".png", np.uint16),
    Case("png-rgb8", 7000, 7000, 3, ".png"),
    Case("png-grey8", 7000, 7000, 1, ".png"),
    Case("jpeg-baseline", 8000, 6000, 3, ".jpg"),
    Case("jpeg-progressive", 8000, 6000, 3, ".jpg", params=(cv2.IMWRITE_JPEG_PROGRESSIVE, 1)),
    Case("gif", 4000, 4000, 3, ".gif"),
    Case(
        "jpeg-progressive-444",
        6000,
        4000,
        3,
        ".jpg",
        params=(
            cv2.IMWRITE_JPEG_PROGRESSIVE,
            1,
            cv2.IMWRITE_JPEG_SAMPLING_FACTOR,
            cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444,
        ),
    ),
    Case("webp-rgba", 5000, 5000, 4, ".webp", params=(cv2.IMWRITE_WEBP_QUALITY, 101)),
    Case("bmp-rgb", 5000, 5000, 3, ".bmp"),
    Case("tiff-rgb16", 4000, 4000, 3, ".tiff", np.uint16),
    Case("tiff-rgba8", 4000, 4000, 4, ".tiff"),
)


def make(case: Case, folder: Path, scale: float = 1.0) -> Path:
    """A smooth picture (compresses well, like the bombs it stands for) with a transparent border."""
    w, h = max(8, int(case.width * scale)), max(8, int(case.height * scale))
    top = np.iinfo(case.depth).max
    ramp: np.ndarray = np.linspace(0, top, w, dtype=np.float64).astype(case.depth)
    img: np.ndarray = np.empty((h, w, case.channels), case.depth)
    img[:] = ramp[None, :, None]
    if case.channels == 4:
        img[:, :, 3] = top
        img[: h // 8, :, 3] = 0
    ok, buf = cv2.imencode(case.ext, img[:, :, 0] if case.channels == 1 else img, list(case.params))
    if not ok:
        raise RuntimeError(f"cannot encode {case.name}")
    path = folder / f"{case.name}{case.ext}"
    path.write_bytes(buf.tobytes())
    return path


def _status(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS now, VmHWM the peak of this process image: unlike
    ``ru_maxrss`` it does not inherit the parent's peak across fork and exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def one(path: Path) -> dict[str, float]:
    """In the child (``python -m loadtests.harness.decode_cases PATH``): prepare the image once with
    an unlimited budget, report the peak growth."""
    cv2.setNumThreads(1)
    data = path.read_bytes()
    config = PreprocessConfig(max_image_bytes=1 << 62)
    # One-time costs (the codec's code pages, its tables and thread-local buffers) are not per image:
    # pay them on a small picture of the same format before measuring.
    tiny = np.zeros((64, 64, 4 if path.suffix in (".png", ".webp", ".tiff") else 3), np.uint8)
    prepare(cv2.imencode(path.suffix, tiny)[1].tobytes(), config)
    estimate = decoded_bytes(probe(data), config)
    before = _status("VmRSS")
    started = time.perf_counter()
    prepare(data, config)
    seconds = time.perf_counter() - started
    peak = _status("VmHWM")
    return {"estimate": estimate, "peak": max(0, peak - before), "seconds": seconds, "file": len(data)}


def measure(path: Path) -> dict[str, float]:
    """Peak growth of a fresh process preparing ``path`` (see the module docstring)."""
    out = subprocess.run(
        [sys.executable, "-m", "loadtests.harness.decode_cases", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


if __name__ == "__main__":
    print(json.dumps(one(Path(sys.argv[1]))))
