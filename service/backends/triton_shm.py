"""A pool of system shared-memory regions registered with Triton, reused across batches.

One input and one output region per in-flight batch, each sized for the largest batch, created
once. Triton forgets registrations when it restarts, so each pair remembers whether it is
registered and the backend re-registers after such an error. A pair whose call failed or was
abandoned may still be written by Triton, so it is never reused: it is replaced by a fresh pair
under new names.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import tritonclient.utils.shared_memory as shm

logger = logging.getLogger(__name__)


class ShmClient(Protocol):
    async def register_system_shared_memory(self, name: str, key: str, byte_size: int) -> Any: ...
    async def unregister_system_shared_memory(self, name: str = "") -> Any: ...


@dataclass
class Region:
    name: str
    byte_size: int
    handle: Any

    @classmethod
    def create(cls, name: str, byte_size: int) -> Region:
        return cls(name, byte_size, shm.create_shared_memory_region(name, f"/{name}", byte_size))

    @property
    def key(self) -> str:
        return f"/{self.name}"


@dataclass
class RegionPair:
    input: Region
    output: Region
    registered: bool = False


class SharedMemoryPool:
    def __init__(self, count: int, input_bytes: int, output_bytes: int) -> None:
        self._prefix = f"gateway-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._serial = 0
        self._sizes = (input_bytes, output_bytes)
        self._free: asyncio.Queue[RegionPair] = asyncio.Queue()
        self._all: set[int] = set()
        self.pairs: list[RegionPair] = []
        for _ in range(count):
            self._add(self._new_pair())

    def _new_pair(self) -> RegionPair:
        self._serial += 1
        name = f"{self._prefix}-{self._serial}"
        return RegionPair(Region.create(f"{name}-in", self._sizes[0]), Region.create(f"{name}-out", self._sizes[1]))

    def _add(self, pair: RegionPair) -> None:
        self.pairs.append(pair)
        self._free.put_nowait(pair)

    def forget_registrations(self) -> None:
        """Triton restarted or lost our regions: register again before the next use."""
        for pair in self.pairs:
            pair.registered = False

    async def acquire(self, client: ShmClient) -> RegionPair:
        pair = await self._free.get()
        if not pair.registered:
            try:
                for region in (pair.input, pair.output):
                    await client.register_system_shared_memory(region.name, region.key, region.byte_size)
            except BaseException:
                self._free.put_nowait(pair)
                raise
            pair.registered = True
        return pair

    def release(self, pair: RegionPair) -> None:
        self._free.put_nowait(pair)

    async def discard(self, pair: RegionPair, client: ShmClient) -> None:
        """Replace a pair that Triton may still write to with a fresh one."""
        self.pairs.remove(pair)
        self._add(self._new_pair())
        await self._destroy(pair, client)

    async def _destroy(self, pair: RegionPair, client: ShmClient | None) -> None:
        for region in (pair.input, pair.output):
            if client is not None and pair.registered:
                try:
                    async with asyncio.timeout(2.0):  # a hung Triton must not hold up the batch's cleanup
                        await client.unregister_system_shared_memory(region.name)
                except Exception as exc:  # Triton may be down; its registrations die with it
                    logger.debug("triton: could not unregister %s: %s", region.name, exc)
            shm.destroy_shared_memory_region(region.handle)

    @staticmethod
    def write(region: Region, array: np.ndarray) -> None:
        shm.set_shared_memory_region(region.handle, [np.ascontiguousarray(array)])

    @staticmethod
    def read(region: Region, shape: tuple[int, ...]) -> np.ndarray:
        return np.array(shm.get_contents_as_numpy(region.handle, np.float32, shape), copy=True)

    async def aclose(self, client: ShmClient | None) -> None:
        for pair in list(self.pairs):
            await self._destroy(pair, client)
        self.pairs.clear()
