"""CPUs the process may use, from cgroup files laid out as the kernel does."""

from __future__ import annotations

import os
from pathlib import Path

from service.host.cpus import available_cpus, cgroup_quota
from service.settings import Settings
from service.settings.fields import DECODE_THREADS_PER_CPU


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cgroup_quota(tmp_path) == 2.5
    assert available_cpus(tmp_path) == min(3, len(os.sched_getaffinity(0)))


def test_cgroup_v2_without_a_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(tmp_path) is None
    assert available_cpus(tmp_path) == len(os.sched_getaffinity(0))


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota(tmp_path) == 0.5
    assert available_cpus(tmp_path) == 1  # never 0


def test_settings_size_pools_from_the_usable_cpus() -> None:
    """Not os.cpu_count(): this process's affinity (and quota) is what it can use."""
    assert Settings().preprocess_workers == DECODE_THREADS_PER_CPU * available_cpus()
