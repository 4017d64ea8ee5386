"""A pool of system shared-memory regions registered with Triton, reused across batches.

One input and one output region per in-flight batch, each sized for the largest batch, created
once. Triton forgets registrations when it restarts, so each region remembers whether it is
registered and the backend re-registers after such an error. Registration is per region and
idempotent: a region Triton already knows ("already in manager", e.g. after a failure between the
input's and the output's registration) counts as registered. A pair whose call failed or was
abandoned may still be written by Triton, so it is never reused: it is replaced by a fresh pair
under new names; if the replacement cannot be created (``/dev/shm`` full), the pool remembers the
missing pair and creates it at the next acquire, so it never shrinks, and a half-created pair is
destroyed, so nothing leaks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Sequence
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
    registered: bool = False

    @classmethod
    def create(cls, name: str, byte_size: int) -> Region:
        return cls(name, byte_size, shm.create_shared_memory_region(name, f"/{name}", byte_size))

    @property
    def key(self) -> str:
        return f"/{self.name}"

    async def register(self, client: ShmClient) -> None:
        if self.registered:
            return
        try:
            await client.register_system_shared_memory(self.name, self.key, self.byte_size)
        except Exception as exc:
            if "already in manager" not in str(exc).lower():
                raise
        self.registered = True


@dataclass
class RegionPair:
    input: Region
    output: Region

    @property
    def regions(self) -> tuple[Region, Region]:
        return (self.input, self.output)


class SharedMemoryPool:
    def __init__(self, count: int, input_bytes: int, output_bytes: int) -> None:
        self._prefix = f"gateway-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._serial = 0
        self._sizes = (input_bytes, output_bytes)
        self._free: asyncio.Queue[RegionPair] = asyncio.Queue()
        self.size = count
        """Pairs the pool holds, free, in use, or owed (see ``missing``)."""
        self.pairs: list[RegionPair] = []
        for _ in range(count):
            self._add(self._new_pair())

    @property
    def missing(self) -> int:
        """Pairs that could not be created yet; the next acquire tries again."""
        return self.size - len(self.pairs)

    def _new_pair(self) -> RegionPair:
        self._serial += 1
        name = f"{self._prefix}-{self._serial}"
        first = Region.create(f"{name}-in", self._sizes[0])
        try:
            return RegionPair(first, Region.create(f"{name}-out", self._sizes[1]))
        except BaseException:
            shm.destroy_shared_memory_region(first.handle)
            raise

    def _add(self, pair: RegionPair) -> None:
        self.pairs.append(pair)
        self._free.put_nowait(pair)

    def _replenish(self) -> None:
        while self.missing > 0:
            try:
                self._add(self._new_pair())
            except Exception as exc:
                logger.error("triton: cannot create a shared-memory region pair (%s); %d missing", exc, self.missing)
                return

    def forget_registrations(self) -> None:
        """Triton restarted or lost our regions: register again before the next use."""
        for pair in self.pairs:
            for region in pair.regions:
                region.registered = False

    async def acquire(self, client: ShmClient) -> RegionPair:
        self._replenish()
        pair = await self._free.get()
        try:
            for region in pair.regions:
                await region.register(client)
        except BaseException:
            self._free.put_nowait(pair)
            raise
        return pair

    def release(self, pair: RegionPair) -> None:
        self._free.put_nowait(pair)

    async def discard(self, pair: RegionPair, client: ShmClient) -> None:
        """Replace a pair that Triton may still write to with a fresh one."""
        self.pairs.remove(pair)
        self._replenish()
        await self._destroy(pair, client)

    async def _destroy(self, pair: RegionPair, client: ShmClient | None) -> None:
        for region in pair.regions:
            if client is not None and region.registered:
                try:
                    async with asyncio.timeout(2.0):  # a hung Triton must not hold up the batch's cleanup
                        await client.unregister_system_shared_memory(region.name)
                except Exception as exc:  # Triton may be down; its registrations die with it
                    logger.debug("triton: could not unregister %s: %s", region.name, exc)
            shm.destroy_shared_memory_region(region.handle)

    @staticmethod
    def write(region: Region, images: Sequence[np.ndarray] | np.ndarray) -> int:
        """Copy the images one after another into the region (no batch array in between); return
        the bytes written."""
        arrays = [np.ascontiguousarray(image) for image in images]
        if len({a.shape for a in arrays}) > 1:
            raise ValueError(f"the images of a batch differ in shape: {sorted({a.shape for a in arrays})}")
        size = sum(a.nbytes for a in arrays)
        if size > region.byte_size:
            raise ValueError(f"a batch of {size} bytes does not fit the {region.byte_size}-byte region {region.name}")
        shm.set_shared_memory_region(region.handle, arrays)
        return size

    @staticmethod
    def read(region: Region, shape: tuple[int, ...]) -> np.ndarray:
        return np.array(shm.get_contents_as_numpy(region.handle, np.float32, shape), copy=True)

    async def aclose(self, client: ShmClient | None) -> None:
        for pair in list(self.pairs):
            await self._destroy(pair, client)
        self.pairs.clear()
