"""Triton's own settings under ``gateway tune``, on a real tritonserver in explicit model-control
mode: the model's config.pbtxt is rewritten and reloaded per candidate, the chosen settings are
what Triton serves afterwards, and a tune that chooses nothing puts the file back as it was."""

from __future__ import annotations

import asyncio
import csv
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from service.cli import main
from service.models.profiles import get_profile
from service.models.store import ensure_model
from service.triton.model_config import ReloadRefused, TritonModel
from service.triton.repository import TritonOptions, write_model
from service.triton.server import LocalTriton, TritonInstall
from service.tune.loadgen import closed_loop
from service.tune.report import read_env
from service.tune.runner import gateway_process
from tests.triton_server import start_triton

pytestmark = pytest.mark.triton

MODEL = "trivial"


@pytest.fixture(scope="module")
def explicit_triton(
    triton_install: TritonInstall, models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LocalTriton, Path]]:
    repository = tmp_path_factory.mktemp("tune-repo")
    profile = get_profile(MODEL)
    options = TritonOptions(variant="python", max_batch_size=16, intra_op_threads=1, max_queue_delay_us=2000)
    write_model(repository, profile, options, ensure_model(models_dir, profile))
    server = start_triton(
        triton_install,
        repository,
        tmp_path_factory.mktemp("tune-triton-logs"),
        extra_args=("--model-control-mode=explicit", f"--load-model={MODEL}"),
    )
    yield server, repository
    server.stop()


def served_config(server: LocalTriton) -> mc.ModelConfig:
    client = tritonclient.grpc.InferenceServerClient(server.grpc_url)
    try:
        return client.get_model_config(MODEL).config
    finally:
        client.close()


def tune(photos: Path, server: LocalTriton, repository: Path, models_dir: Path, out: Path, slo_ms: float) -> int:
    return main(
        [
            "tune",
            str(photos),
            "--backend",
            "triton",
            "--triton-url",
            server.grpc_url,
            "--model",
            MODEL,
            "--models-dir",
            str(models_dir),
            "--triton-repository",
            str(repository),
            "--triton-instances",
            "1,2",
            "--triton-delays-us",
            "0,2000",
            # the gateway's own settings held still, so the search walks Triton's
            "--batches",
            "16",
            "--delays-ms",
            "2",
            "--inflight",
            "2",
            "--worker-counts",
            "1",
            "--policies",
            "adaptive",
            "--quick",
            "--max-concurrency",  # two client levels (1, 4): the walk over Triton's settings is tested, not the sweep
            "4",
            "--slo-p99-ms",
            str(slo_ms),
            "--out",
            str(out / "tuned.env"),
            "--report",
            str(out / "report"),
        ]
    )


@pytest.fixture
def photos(tmp_path: Path, cat_jpeg: bytes, coffee_jpeg: bytes) -> Path:
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.jpg").write_bytes(cat_jpeg)
    (folder / "coffee.jpg").write_bytes(coffee_jpeg)
    return folder


def test_apply_rewrites_only_the_tuned_fields_and_triton_serves_them(
    explicit_triton: tuple[LocalTriton, Path],
) -> None:
    server, repository = explicit_triton
    model = TritonModel(repository, MODEL, server.grpc_url)
    before = model.read()
    original = model.path.read_text()
    try:
        assert model.apply(2, 500) is True
        after = model.read()
        assert [g.count for g in after.instance_group] == [2]
        assert after.dynamic_batching.max_queue_delay_microseconds == 500
        # everything else as it was
        after.instance_group[0].count = before.instance_group[0].count
        after.dynamic_batching.max_queue_delay_microseconds = before.dynamic_batching.max_queue_delay_microseconds
        assert after == before
        served = served_config(server)
        assert served.instance_group[0].count == 2
        assert served.dynamic_batching.max_queue_delay_microseconds == 500
        assert model.apply(2, 500) is False  # nothing changed, nothing reloaded
    finally:
        model.write(original)
        model.reload()
    assert served_config(server).instance_group[0].count == before.instance_group[0].count


def test_a_model_without_dynamic_batching_cannot_have_its_queue_delay_tuned(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.pbtxt").write_text('name: "plain"\nbackend: "python"\nmax_batch_size: 8\n')
    model = TritonModel(tmp_path, "plain", "127.0.0.1:1")  # refused before any request is made
    with pytest.raises(ReloadRefused, match="no dynamic_batching"):
        model.check_tunable(delay=True)
    parsed = text_format.Parse((tmp_path / "plain" / "config.pbtxt").read_text(), mc.ModelConfig())
    assert not parsed.HasField("dynamic_batching")


@pytest.mark.slow
def test_tune_chooses_tritons_settings_and_leaves_triton_serving_them(
    explicit_triton: tuple[LocalTriton, Path], models_dir: Path, photos: Path, tmp_path: Path, cat_jpeg: bytes
) -> None:
    server, repository = explicit_triton
    model = TritonModel(repository, MODEL, server.grpc_url)
    original = model.path.read_text()
    slo_ms = 150.0
    try:
        assert tune(photos, server, repository, models_dir, tmp_path, slo_ms) == 0
        picked = json.loads((tmp_path / "report" / "chosen.json").read_text())
        instances = picked["triton"]["instance_group.count"]
        delay = picked["triton"]["dynamic_batching.max_queue_delay_microseconds"]
        # the repository holds the chosen settings, and Triton serves them
        assert model.settings().instances == instances
        assert model.settings().queue_delay_us == delay
        served = served_config(server)
        assert (served.instance_group[0].count, served.dynamic_batching.max_queue_delay_microseconds) == (
            instances,
            delay,
        )
        assert (tmp_path / "report" / "config.pbtxt.before").read_text() == original
        with (tmp_path / "report" / "candidates.csv").open() as f:
            rows = list(csv.DictReader(f))
        assert {row["triton_instances"] for row in rows} == {"1", "2"}  # the search walked Triton's settings
        assert {row["triton_delay_us"] for row in rows} == {"0", "2000"}
        env_text = (tmp_path / "tuned.env").read_text()
        assert f"instance_group.count {instances}" in env_text
        tuned = read_env(tmp_path / "tuned.env")
        assert tuned["GATEWAY_BACKEND"] == "triton"

        async def rerun() -> float:
            async with gateway_process(tuned, tmp_path / "rerun.log") as url:
                load = await closed_loop(url, [cat_jpeg], picked["level"]["concurrency"], 3.0)
            assert load.failures == 0
            return load.percentile_ms(99)

        assert asyncio.run(rerun()) <= slo_ms
    finally:
        model.write(original)
        model.reload()


@pytest.mark.slow
def test_a_tune_that_chooses_nothing_puts_tritons_config_back(
    explicit_triton: tuple[LocalTriton, Path], models_dir: Path, photos: Path, tmp_path: Path
) -> None:
    server, repository = explicit_triton
    model = TritonModel(repository, MODEL, server.grpc_url)
    original = model.path.read_text()
    assert tune(photos, server, repository, models_dir, tmp_path, slo_ms=0.01) == 1
    assert not (tmp_path / "tuned.env").exists()
    assert model.path.read_text() == original
    served = served_config(server)
    assert served.instance_group[0].count == 1
    assert served.dynamic_batching.max_queue_delay_microseconds == 2000
