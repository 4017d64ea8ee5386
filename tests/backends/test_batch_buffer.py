"""How backends lay out a batch: ``BatchBuffer`` (one reused array per thread) and the shared-memory
pool's write (each image straight into the region)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import service.backends.triton_shm as triton_shm
from service.backends.base import BatchBuffer, stack_into
from service.backends.triton_shm import SharedMemoryPool


def images(count: int, side: int = 8, start: int = 0) -> list[np.ndarray]:
    return [np.full((side, side, 3), start + i, np.uint8) for i in range(count)]


def test_a_batch_is_the_images_in_order_in_one_reused_array() -> None:
    buffer = BatchBuffer()
    first = buffer.assemble(images(4))
    assert np.array_equal(first, np.stack(images(4)))
    second = buffer.assemble(images(3, start=10))
    assert np.array_equal(second, np.stack(images(3, start=10)))
    assert np.shares_memory(first, second)  # no new allocation for a batch that fits


def test_the_buffer_grows_for_a_larger_batch_and_follows_a_new_image_shape() -> None:
    buffer = BatchBuffer()
    small = buffer.assemble(images(2))
    large = buffer.assemble(images(5, start=1))
    assert large.shape == (5, 8, 8, 3)
    assert np.array_equal(large, np.stack(images(5, start=1)))
    assert not np.shares_memory(small, large)
    other = buffer.assemble(images(2, side=4))
    assert other.shape == (2, 4, 4, 3)
    assert np.array_equal(other, np.stack(images(2, side=4)))


def test_a_stacked_batch_is_used_as_it_is() -> None:
    batch = np.stack(images(3))
    assert BatchBuffer().assemble(batch) is batch


def test_a_padded_batch_has_the_rows_asked_for_from_the_given_allocator() -> None:
    made: list[tuple[int, ...]] = []

    def allocate(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:  # type: ignore[type-arg]
        made.append(shape)
        return np.full(shape, 255, dtype)

    buffer = BatchBuffer(allocate)
    padded = buffer.assemble(images(3), rows=4)
    assert padded.shape == (4, 8, 8, 3)
    assert np.array_equal(padded[:3], np.stack(images(3)))
    assert made == [(4, 8, 8, 3)]
    stacked = buffer.assemble(np.stack(images(2, start=20)), rows=4)  # a stacked batch too short is copied
    assert stacked.shape == (4, 8, 8, 3)
    assert np.array_equal(stacked[:2], np.stack(images(2, start=20)))
    assert np.shares_memory(padded, stacked)
    assert made == [(4, 8, 8, 3)]


def test_images_of_different_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="same shape"):
        BatchBuffer().assemble([np.zeros((8, 8, 3), np.uint8), np.zeros((4, 4, 3), np.uint8)])


def test_stacking_copies_views_and_any_channel_count_into_the_given_array() -> None:
    """The one-call copy (``cv2.vconcat`` into the batch seen as one tall image) lays out crops of a
    larger picture (views with their own row stride) and 1-4 channels exactly as ``np.stack``, into
    the array given, never into one of its own; other sample types are stacked by NumPy."""
    rng = np.random.default_rng(1)
    for channels in (1, 3, 4):
        pictures = [rng.integers(0, 256, (20, 24, channels), np.uint8) for _ in range(5)]
        crops = [p[3:15, 5:17] for p in pictures]  # 12 x 12 views, not contiguous
        out = np.zeros((5, 12, 12, channels), np.uint8)
        stack_into(out, crops)
        assert np.array_equal(out, np.stack(crops))
    floats = [rng.random((6, 6, 3)).astype(np.float32) for _ in range(3)]
    out32 = np.zeros((3, 6, 6, 3), np.float32)
    stack_into(out32, floats)
    assert np.array_equal(out32, np.stack(floats))
    with pytest.raises(ValueError, match="same shape"):
        stack_into(np.zeros((2, 8, 8, 3), np.uint8), images(3))  # more images than rows


def test_each_thread_has_its_own_array() -> None:
    """Batches in flight together run in different threads: one must not overwrite another's."""
    buffer = BatchBuffer()
    mine = buffer.assemble(images(2))
    theirs: list[np.ndarray] = []
    thread = threading.Thread(target=lambda: theirs.append(buffer.assemble(images(2, start=50))))
    thread.start()
    thread.join()
    assert not np.shares_memory(mine, theirs[0])
    assert np.array_equal(mine, np.stack(images(2)))


def test_shared_memory_gets_each_image_in_place_and_refuses_what_does_not_fit() -> None:
    pool = SharedMemoryPool(1, input_bytes=4 * 8 * 8 * 3, output_bytes=16)
    try:
        (pair,) = pool.pairs
        written = pool.write(pair.input, images(3, start=7))
        assert written == 3 * 8 * 8 * 3
        stored = triton_shm.shm.get_contents_as_numpy(pair.input.handle, np.uint8, (3, 8, 8, 3))
        assert np.array_equal(stored, np.stack(images(3, start=7)))
        del stored  # a view of the region, which cannot be closed while it exists
        with pytest.raises(ValueError, match="does not fit"):
            pool.write(pair.input, images(5))
        with pytest.raises(ValueError, match="differ in shape"):
            pool.write(pair.input, [np.zeros((8, 8, 3), np.uint8), np.zeros((4, 4, 3), np.uint8)])
    finally:
        asyncio.run(pool.aclose(None))
