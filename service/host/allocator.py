"""The C allocator's thresholds for a process that decodes images (glibc's malloc, via ``mallopt``).

Every image the pipeline handles passes through buffers of 0.1-5 MB: the request body, the decoded
picture, the model-sized crop (150 KB at 224 px). The crop is allocated in a decode thread and
freed on the event loop once its batch is answered. glibc serves blocks from 128 KB up with
``mmap`` and sets its thresholds from the sizes freed, so these blocks keep crossing them: the
decode threads' heaps are trimmed and grown again, and under load each request cost the decode
threads 2-3 page faults and the event loop a ``madvise``, 15-40 µs of system time per image on the
serving-path benchmark. Fixed thresholds keep blocks under ``MMAP_THRESHOLD`` on the heaps and let
up to ``TRIM_THRESHOLD`` of freed memory stay at each heap's top for the next image.

An operator's own ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` win: nothing is changed
then. Elsewhere than glibc (musl, macOS) nothing is changed either.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""``mallopt`` parameters (glibc's malloc.h)."""
MMAP_THRESHOLD = 4 << 20
"""Blocks up to this size come from the heaps (a 12 MP photo decoded at 1/4 scale is 2.3 MB)."""
TRIM_THRESHOLD = 8 << 20
"""Free memory a heap keeps at its top before it gives it back to the system."""
_OPERATOR_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_image_buffers() -> bool:
    """Fix glibc's thresholds for this process (see the module's text); True when they were set."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in _OPERATOR_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl has a mallopt that does nothing
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        logger.warning("could not set malloc's thresholds; image buffers will be mapped and unmapped per image")
        return False
    return True
