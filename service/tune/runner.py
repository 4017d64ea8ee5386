"""Measuring a candidate for real: a gateway process started with its settings on a free loopback
port, swept over concurrent clients with the closed-loop load of :mod:`service.tune.loadgen`, stopped."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import aiohttp

from service.triton.model_config import ReloadRefused, TritonModel
from service.tune.loadgen import closed_loop
from service.tune.search import Candidate, Level, Target, Trial

GROWTH = 1.03
"""A level that adds less than 3 % throughput over the best so far counts as saturated."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GatewayFailed(RuntimeError):
    """The gateway exited or never became ready with a candidate's settings."""


@contextlib.asynccontextmanager
async def gateway_process(env: Mapping[str, str], log: Path, ready_timeout: float = 180.0) -> AsyncIterator[str]:
    """``gateway serve`` with ``env`` on a free port; yields its URL once /readyz answers 200."""
    port = free_port()
    with log.open("ab") as out:
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", str(port)),
            env={**os.environ, "GATEWAY_LOG_LEVEL": "warning", **env},
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_ready(proc, url, ready_timeout, log)
        yield url
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _wait_ready(proc: asyncio.subprocess.Process, url: str, timeout: float, log: Path) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while loop.time() < deadline:
            if proc.returncode is not None:
                raise GatewayFailed(f"gateway exited with status {proc.returncode} (log: {log})")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(f"{url}/readyz") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise GatewayFailed(f"gateway not ready after {timeout:g} s (log: {log})")


class GatewayMeasure:
    """The ``measure`` of :func:`service.tune.search.search`: each call applies the candidate's
    Triton settings to the model's repository (reloading it) when Triton is tuned, starts a gateway
    with the base environment plus the candidate's settings, and sweeps it."""

    def __init__(
        self,
        base_env: Mapping[str, str],
        images: Sequence[bytes],
        target: Target,
        workdir: Path,
        triton: TritonModel | None = None,
    ):
        self.base_env = dict(base_env)
        self.images = images
        self.target = target
        self.workdir = workdir
        self.triton = triton

    async def __call__(self, candidate: Candidate, concurrency: Sequence[int], seconds: float, stage: str) -> Trial:
        trial = Trial(candidate, stage, seconds)
        log = self.workdir / "gateway.log"
        try:
            if self.triton is not None and candidate.server():
                await asyncio.to_thread(self.triton.apply, candidate.triton_instances, candidate.triton_delay_us)
            async with gateway_process({**self.base_env, **candidate.env()}, log) as url:
                await sweep(url, self.images, concurrency, seconds, self.target, trial)
        except (GatewayFailed, ReloadRefused) as exc:
            trial.error = str(exc)
        return trial


async def sweep(
    url: str, images: Sequence[bytes], concurrency: Sequence[int], seconds: float, target: Target, trial: Trial
) -> None:
    """Raise the client count through ``concurrency`` until the target is missed (more clients in a
    closed loop only add latency from there) or throughput stops growing."""
    best = 0.0
    flat = 0
    for clients in concurrency:
        load = await closed_loop(url, images, clients, seconds, warmup=min(0.5, seconds / 2))
        level = Level(clients, load.throughput, load.percentile_ms(50), load.percentile_ms(99), load.failure_share)
        trial.levels.append(level)
        if not target.meets(level):
            break
        flat = flat + 1 if level.throughput < best * GROWTH else 0
        best = max(best, level.throughput)
        if flat == 2:
            break
