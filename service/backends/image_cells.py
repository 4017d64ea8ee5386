"""Images decoded straight into memory the shared engine reads: a worker's block of cells.

A worker's block (``service.backends.engine``) is cut into cells of one image each. A decoder asks
for a cell (``allocate``) and writes its image there; the batch that carries the image later names
the cell to the engine instead of copying the image (``index``). A cell is free again once nothing
references its array (a ``weakref.finalize`` on it): one held by a request, the batcher's queue or
a call the engine has not yet answered stays taken, so the engine never reads a cell that is being
written. When every cell is taken, ``allocate`` says so (None) and the decoder writes where it
always did; such images are copied into a batch slot as before (the batch's other images are not).

Cells are handed out last freed first, so the pages in use stay few and warm. ``allocate`` and the
finalizers run in any thread (the decode pool, the event loop): ``deque`` appends and pops, and
``dict`` sets, gets and deletes, are atomic."""

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
        self._taken: dict[int, int] = {}
        """``id`` of each cell's array handed out to its cell (an id is not reused before its
        array's finalizer has removed it)."""

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
        self._taken[id(cell)] = index
        weakref.finalize(cell, self._release, id(cell), index).atexit = False
        return cell

    def _release(self, key: int, index: int) -> None:
        del self._taken[key]
        self._free.append(index)

    def index(self, image: np.ndarray) -> int | None:
        """The cell ``image`` is, or None: a cell's array as handed out, or a view of one whose
        memory is the whole cell (either keeps the cell taken). Any other array is None, even one
        over a cell's memory that does not hold the cell. Looked up by identity, once per image of
        every batch on the event loop: the address is worked out only for views."""
        if image.dtype != np.uint8 or image.shape != self._shape or not image.flags.c_contiguous:
            return None
        index = self._taken.get(id(image))
        if index is not None or not isinstance(image.base, np.ndarray):
            return index
        index = self._taken.get(id(image.base))
        if index is None or image.__array_interface__["data"][0] != self._base + index * self._bytes:
            return None
        return index

    def indices(self, images: Images) -> list[int | None]:
        """Each image's cell, or None for one that is not in a cell (it is copied)."""
        if isinstance(images, np.ndarray):
            return [None] * len(images)  # stacked by its caller: not cells
        return [self.index(image) for image in images]
