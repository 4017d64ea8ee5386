from __future__ import annotations

from dataclasses import replace

import pytest

from loadtests.harness.grid import ASYNC_DEPTH, PROFILES, Config, build_grid


def test_quick_grid_covers_the_studys_factors_once_each() -> None:
    grid = build_grid(PROFILES["quick"])
    assert len(grid) == len(set(grid))
    assert len({c.label for c in grid}) == len(grid)
    assert {c.architecture for c in grid} == {"simple", "microservice", "distributed"}
    assert {c.client for c in grid} == {"gateway", "offline", "direct", "perf_analyzer"}
    assert {c.submission for c in grid} == {"sync", "async"}
    assert {c.protocol for c in grid if c.architecture != "simple"} == {"grpc", "http"}
    assert {c.protocol for c in grid if c.architecture == "simple"} == {"-"}
    assert {c.dataset for c in grid} == {"files", "files-x9", "memory", "tensors"}
    for c in grid:
        # tensors are what the clients without photos send, and only they
        assert (c.dataset == "tensors") == (c.client in ("direct", "perf_analyzer"))
        assert c.client != "direct" or c.architecture == "simple"
        assert c.client != "perf_analyzer" or c.architecture in ("microservice", "distributed")
        if c.dataset in ("files-x9", "memory") or c.client == "offline":
            assert c.batch in PROFILES["quick"].variant_batches  # type: ignore[operator]


def test_grid_keeps_each_batch_size_together() -> None:
    """The runner starts gateways per batch size and interleaves the architectures within it, so the
    grid must not come back to a batch size it has left."""
    grid = build_grid(PROFILES["full"])
    seen: list[int] = []
    for c in grid:
        if not seen or seen[-1] != c.batch:
            assert c.batch not in seen
            seen.append(c.batch)
    assert seen == [1, 2, 4, 8, 16, 32, 64]
    assert len({c.architecture for c in grid}) == 3


def test_in_flight_and_images_per_run() -> None:
    profile = PROFILES["quick"]
    sync = Config("simple", "gateway", "-", "sync", 8, "files")
    asyn = Config("simple", "gateway", "-", "async", 8, "files")
    perf = Config("microservice", "perf_analyzer", "grpc", "async", 8, "tensors")
    assert sync.in_flight == 8
    assert asyn.in_flight == ASYNC_DEPTH * 8
    assert perf.in_flight == 16
    assert profile.images_for(sync) == profile.images
    assert profile.images_for(asyn) == max(profile.images, 4 * ASYNC_DEPTH * 8)
    assert asyn.series == "simple gateway async files"


def test_profile_check_names_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="--protocols: unknown quic"):
        replace(PROFILES["quick"], protocols=("grpc", "quic")).check()
    with pytest.raises(ValueError, match="--batches"):
        replace(PROFILES["quick"], batches=(0, 8)).check()
    PROFILES["full"].check()
