"""The shared-memory region pool against a real Triton: registration that fails half-way, and
replacement regions that cannot be created."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import service.backends.triton_shm as triton_shm
from service.backends.triton import TritonBackend
from service.backends.triton_shm import Region, SharedMemoryPool
from service.triton.server import LocalTriton

pytestmark = pytest.mark.triton

BATCH = np.zeros((2, 224, 224, 3), np.uint8)


class FailsOnce:
    """The real client, except that registering the first output region fails (a dropped connection,
    after the input region was registered)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.failed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def register_system_shared_memory(self, name: str, key: str, byte_size: int) -> Any:
        if name.endswith("-out") and not self.failed:
            self.failed = True
            raise ConnectionResetError("simulated: the connection dropped during registration")
        return await self.client.register_system_shared_memory(name, key, byte_size)


async def test_a_half_registered_pair_serves_the_next_batch(triton: LocalTriton) -> None:
    """The input region got registered, the output's registration failed: the next batch registers
    only what is missing (Triton already knows the input) and is served. Before, every later batch
    failed with "already in manager"."""
    backend = TritonBackend(
        url=triton.grpc_url, model="efficientnet-lite0", shared_memory=True, shared_memory_regions=1
    )
    await backend.start()
    real = backend._client
    backend._client = FailsOnce(real)
    try:
        with pytest.raises(Exception, match="ConnectionResetError"):
            await backend.infer(BATCH, timeout=30)
        for _ in range(3):
            scores = await backend.infer(BATCH, timeout=30)
            assert scores.shape == (2, 1000)
        status = await real.get_system_shared_memory_status(as_json=True)
        assert len(status.get("regions", {})) == 2  # one pair, nothing left over
    finally:
        backend._client = real
        await backend.aclose()


def _shm_files(prefix: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix))


async def test_a_replacement_that_cannot_be_created_leaks_nothing_and_is_made_later(
    triton: LocalTriton, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Creating a replacement pair fails after its input region was made (/dev/shm full): the
    half-made region is destroyed, the pool owes one pair instead of shrinking, and the next
    acquire creates it."""
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(triton.grpc_url)
    pool = SharedMemoryPool(2, BATCH.nbytes, 2 * 1000 * 4)
    prefix = pool.pairs[0].input.name.rsplit("-", 2)[0]
    try:
        pair = await pool.acquire(client)
        real_create = Region.create

        def failing_create(name: str, byte_size: int) -> Region:
            if name.endswith("-out"):
                raise OSError(28, "No space left on device")
            return real_create(name, byte_size)

        monkeypatch.setattr(triton_shm.Region, "create", failing_create)
        await pool.discard(pair, client)  # the call that used it failed: replace it
        assert pool.missing == 1
        assert len(_shm_files(prefix)) == 2  # the surviving pair only: the half-made input is gone
        monkeypatch.setattr(triton_shm.Region, "create", real_create)
        first = await pool.acquire(client)
        second = await pool.acquire(client)
        assert pool.missing == 0
        assert {first.input.name, second.input.name} == {p.input.name for p in pool.pairs}
        assert len(_shm_files(prefix)) == 4
    finally:
        await pool.aclose(client)
        await client.close()
    assert _shm_files(prefix) == []
