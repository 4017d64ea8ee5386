"""The C allocator's thresholds for image buffers (``service.host.allocator``), in fresh interpreters:
they are process-wide, and glibc reads its environment once, at start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import resource, numpy as np
from service.host.allocator import keep_image_buffers
print(keep_image_buffers())
# a 1 MB block mapped, touched and unmapped per use is ~256 page faults each time; kept on the heap, none
blocks = [np.ones(1 << 20, np.uint8) for _ in range(3)]
del blocks
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    block = np.empty(1 << 20, np.uint8)
    block.fill(1)
    del block
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(env: dict[str, str]) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True).stdout
    answer, faults = out.split()
    return answer, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_image_sized_blocks_are_reused_not_mapped_per_use() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    answer, faults = _run(env)
    assert answer == "True"
    assert faults < 50  # glibc left to itself: 244 here (it trims the heap and maps again)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_an_operators_own_malloc_settings_are_left_alone() -> None:
    """MALLOC_MMAP_THRESHOLD_ below the block size: every 1 MB block is mapped anew, as asked."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    answer, faults = _run({**env, "MALLOC_MMAP_THRESHOLD_": str(128 << 10)})
    assert answer == "False"
    assert faults > 200 * 200  # ~256 per use: the operator's threshold stood
