"""Peak memory of preparing one image, per format, against the budget the header reckons.

Each image is prepared in a fresh Python process; the figure is that process's peak RSS
(``VmHWM``) less its RSS just before ``prepare``, so the bytes already read and the imports do
not count. ``estimate`` is ``service.images.preprocess.decoded_bytes``, what ``GATEWAY_MAX_IMAGE_BYTES``
is compared with. Usage::

    python -m loadtests.decode_memory            # the default set, large images (~1 min)
    python -m loadtests.decode_memory --scale 0.4
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from loadtests.harness.decode_cases import CASES, make, measure
from service.images.imageinfo import probe

MB = 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="image side scale (1: the sizes listed)")
    args = parser.parse_args(argv)
    print("| image | size | file KB | budget (MB) | peak RSS growth (MB) | peak / budget | prepare ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            path = make(case, Path(tmp), args.scale)
            r = measure(path)
            info = probe(path.read_bytes())
            print(
                f"| {case.name} | {info.width}x{info.height} | {r['file'] / 1e3:.0f} | {r['estimate'] / MB:.0f} "
                f"| {r['peak'] / MB:.0f} | {r['peak'] / r['estimate']:.2f} | {r['seconds'] * 1e3:.0f} |"
            )
            path.unlink()


if __name__ == "__main__":
    main()
