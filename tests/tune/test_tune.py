"""``gateway tune --quick`` end to end: it tunes a real gateway (embedded model) and writes an env
file; a gateway started with that file meets the SLO at the load the tune measured it at."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from service.cli import main
from service.tune.loadgen import closed_loop
from service.tune.report import read_env
from service.tune.runner import gateway_process


@pytest.mark.slow
def test_quick_tune_writes_settings_that_meet_the_slo(
    tmp_path: Path, models_dir: Path, cat_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "cat.jpg").write_bytes(cat_jpeg)
    (photos / "coffee.jpg").write_bytes(coffee_jpeg)
    env_file, report = tmp_path / "tuned.env", tmp_path / "report"
    slo_ms = 100.0
    status = main(
        [
            "tune",
            str(photos),
            "--model",
            "trivial",
            "--models-dir",
            str(models_dir),
            "--slo-p99-ms",
            str(slo_ms),
            "--quick",
            "--batches",  # a small space (8 candidates): the search's work, not its breadth, is tested here
            "1,16",
            "--delays-ms",
            "0,5",
            "--inflight",
            "2",
            "--worker-counts",
            "1,2",
            "--max-concurrency",  # one client level: the search and its report, not the sweep, are tested here
            "1",
            "--out",
            str(env_file),
            "--report",
            str(report),
        ]
    )
    assert status == 0
    tuned = read_env(env_file)
    assert tuned["GATEWAY_MODEL"] == "trivial"
    assert {"GATEWAY_MAX_BATCH_SIZE", "GATEWAY_MAX_DELAY", "GATEWAY_BATCH_POLICY", "GATEWAY_WORKERS"} <= set(tuned)
    picked = json.loads((report / "chosen.json").read_text())
    assert picked["settings"].items() <= tuned.items()
    assert picked["level"]["p99_ms"] <= 0.8 * slo_ms  # judged with the default headroom
    text = (report / "report.md").read_text()
    assert "**chosen**" in text
    assert (report / "tune.png").stat().st_size > 10_000

    async def rerun() -> float:
        async with gateway_process(tuned, tmp_path / "rerun.log") as url:
            load = await closed_loop(url, [cat_jpeg, coffee_jpeg], picked["level"]["concurrency"], 4.0)
        assert load.failures == 0
        assert load.throughput > 0
        return load.percentile_ms(99)

    assert asyncio.run(rerun()) <= slo_ms
