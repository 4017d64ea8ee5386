"""Images decoded straight into memory the shared engine reads: a worker's block of cells.

A worker's block (``service.backends.engine``) is cut into cells of one image each. A decoder asks
for a cell (``allocate``) and writes its image there; the batch that carries the image later names
the cell to the engine instead of copying the image (``index``). A cell is free again once nothing
references its array (a ``weakref.finalize`` on it): one held by a request, the batcher's queue or
a call the engine has not yet answered stays taken, so the engine never reads a cell that is being
written. When every cell is taken, ``allocate`` says so (None) and the decoder writes where it
always did; such images are copied into a batch slot as before (the batch's other images are not).

Cells are handed out last freed first, so the pages in use stay few and warm. ``allocate`` and the
finalizers run in any thread (the decode pool, the event loop): ``deque`` appends and pops are
atomic."""

from __future__ import annotations

import mmap
import weakref
from collections import deque

import numpy as np

from service.backends.base import Images


class ImageCells:
    """Cells ``first`` to ``first + count - 1`` of a block of ``shape``-sized uint8 images."""

    def __init__(self, block: mmap.mmap, shape: tuple[int, ...], first: int, count: int) -> None:
        self._block = block
        self._shape = shape
        self._bytes = int(np.prod(shape))
        self._first, self._end = first, first + count
        self._base = np.frombuffer(block, np.uint8, count=1).__array_interface__["data"][0]
        self._free: deque[int] = deque(range(self._end - 1, first - 1, -1))  # the lowest first

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self) -> np.ndarray | None:
        """An unused cell as a writable ``shape`` array, or None when every cell is taken."""
        try:
            index = self._free.pop()
        except IndexError:
            return None
        cell = np.ndarray(self._shape, np.uint8, buffer=self._block, offset=index * self._bytes)
        weakref.finalize(cell, self._free.append, index).atexit = False
        return cell

    def index(self, image: np.ndarray) -> int | None:
        """The cell ``image`` is (its memory exactly one of these cells), or None. An array that is
        a cell keeps it taken: it is the cell's array, or a view whose base is."""
        if image.dtype != np.uint8 or image.shape != self._shape or not image.flags.c_contiguous:
            return None
        offset = image.__array_interface__["data"][0] - self._base
        index, rest = divmod(offset, self._bytes)
        return index if rest == 0 and self._first <= index < self._end else None

    def indices(self, images: Images) -> list[int | None]:
        """Each image's cell, or None for one that is not in a cell (it is copied)."""
        if isinstance(images, np.ndarray):
            return [None] * len(images)  # stacked by its caller: not cells
        return [self.index(image) for image in images]
