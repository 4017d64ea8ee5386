"""The image cells of a worker's shared-engine block (``service.backends.image_cells``): decoders
write into cells, a batch names them, and a cell is handed out again only once nothing references
its image."""

from __future__ import annotations

import gc
import mmap
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from service.backends.image_cells import ImageCells

SHAPE = (8, 8, 3)
IMAGE = int(np.prod(SHAPE))


def cells(first: int = 2, count: int = 3) -> ImageCells:
    return ImageCells(mmap.mmap(-1, (first + count) * IMAGE), SHAPE, first, count)


def test_cells_are_handed_out_until_none_is_left() -> None:
    pool = cells()
    taken = [pool.allocate() for _ in range(3)]
    assert all(cell is not None for cell in taken)
    assert sorted(pool.index(cell) for cell in taken if cell is not None) == [2, 3, 4]  # the pool's, not the slots'
    assert pool.allocate() is None
    assert pool.free == 0


def test_a_cell_is_free_again_only_once_nothing_references_its_image() -> None:
    """Not while the image, or any view of it (the batcher's, a call held for the engine), lives."""
    pool = cells(count=1)
    cell = pool.allocate()
    assert cell is not None
    cell[...] = 9
    views = [cell[:], cell.reshape(-1), cell[::2]]
    del cell
    gc.collect()
    assert pool.allocate() is None
    assert views[0].sum() == 9 * IMAGE
    del views
    gc.collect()
    again = pool.allocate()
    assert again is not None
    assert pool.index(again) == 2


def test_only_an_array_that_is_exactly_a_cell_names_one() -> None:
    pool = cells()
    cell = pool.allocate()
    assert cell is not None
    assert pool.index(cell) == pool.index(cell[:]) == pool.index(cell.reshape(SHAPE)) == 2
    whole = np.frombuffer(pool._block, np.uint8).reshape(-1, *SHAPE)
    assert pool.index(whole[1]) is None  # a slot's cell: not the pool's
    assert pool.index(whole[3]) is None  # over a pool cell's memory, but not holding it: it may be handed out
    assert pool.index(whole[2].reshape(-1)[1:].reshape(-1)[: IMAGE - 1]) is None
    assert pool.index(cell[:, ::-1]) is None  # not contiguous
    assert pool.index(cell.astype(np.int16)) is None
    assert pool.index(np.zeros(SHAPE, np.uint8)) is None  # the heap
    odd = np.frombuffer(pool._block, np.uint8, count=IMAGE, offset=2 * IMAGE + 1).reshape(SHAPE)
    assert pool.index(odd) is None  # inside the pool, across two cells
    assert pool.indices([cell, cell[:]]) == [2, 2]
    assert pool.indices([cell, np.zeros(SHAPE, np.uint8)]) == [2, None]
    assert pool.indices(np.stack([cell, cell])) == [None, None]


def test_threads_never_get_the_same_cell() -> None:
    """Decode threads allocate, the event loop frees: each cell is held by one image at a time."""
    pool = cells(count=64)

    def churn(_: int) -> list[int]:
        seen = []
        for _ in range(2000):
            cell = pool.allocate()
            if cell is not None:
                index = pool.index(cell)
                assert index is not None
                cell[...] = index % 256
                assert (cell == index % 256).all()  # nobody else wrote it meanwhile
                seen.append(index)
        return seen

    with ThreadPoolExecutor(8) as threads:
        assert sum(len(seen) for seen in threads.map(churn, range(8))) > 0
    gc.collect()
    assert pool.free == 64
