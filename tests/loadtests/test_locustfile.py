from __future__ import annotations

import csv
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from loadtests.harness.http_load import start_gateway

LOCUST = Path(sys.executable).with_name("locust")
LOCUSTFILE = Path(__file__).resolve().parents[2] / "loadtests" / "locustfile.py"


@pytest.mark.slow
def test_locust_drives_the_gateway_without_failures(tmp_path: Path) -> None:
    proc, url = start_gateway(["--backend", "fake"], Path(tempfile.gettempdir()) / "gateway-bench-models")
    try:
        result = subprocess.run(
            [
                str(LOCUST),
                "-f",
                str(LOCUSTFILE),
                "--host",
                url,
                "--headless",
                "-u",
                "4",
                "-r",
                "4",
                "-t",
                "4s",
                "--csv",
                str(tmp_path / "run"),
                "--only-summary",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=LOCUSTFILE.parents[1],
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert result.returncode == 0, result.stderr[-3000:]
    with (tmp_path / "run_stats.csv").open() as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    assert int(rows["/classify"]["Request Count"]) > 20
    assert int(rows["/classify"]["Failure Count"]) == 0
