"""Render the Grafana dashboard's panels from a real run, for docs/observability.md.

Starts a real Prometheus with the shipped rules, a gateway on the embedded model, drives it with
real photos at rising concurrency (plus some bad requests), then evaluates every query of
deploy/grafana/dashboards/gateway.json over the run and draws the panels with matplotlib. Panels
whose series come from Triton, RabbitMQ or a GPU are drawn empty and say so.

    python -m loadtests.render_dashboard --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtests.harness.http_load import start_gateway
from loadtests.harness.photos import sample_photos
from service.tune.runner import free_port

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "gateway.json"
UNITS = {"s": ("s", 1.0), "bytes": ("MiB", 1 / 2**20), "percentunit": ("%", 100.0)}


async def drive(url: str, phases: list[tuple[int, float]]) -> None:
    photos = [data for _, data in sample_photos()]
    async with aiohttp.ClientSession(url) as session:
        for concurrency, seconds in phases:
            deadline = time.monotonic() + seconds

            async def client(i: int, deadline: float = deadline) -> None:
                n = i
                while time.monotonic() < deadline:
                    n += 1
                    body = photos[n % len(photos)] if n % 25 else b"not an image"
                    async with session.post("/classify", data=body, headers={"content-type": "image/jpeg"}) as r:
                        await r.read()

            await asyncio.gather(*(client(i) for i in range(concurrency)))


def query_range(prom: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    body = httpx.get(
        f"{prom}/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": 2}, timeout=30
    ).json()
    return body["data"]["result"] if body.get("status") == "success" else []


def legend(template: str, labels: dict[str, str]) -> str:
    text = template
    for key, value in labels.items():
        text = text.replace("{{" + key + "}}", value)
    return text.replace("{{", "").replace("}}", "")


def why_empty(panel: dict[str, Any]) -> str:
    exprs = " ".join(t["expr"] for t in panel["targets"])
    if any(word in exprs for word in ("nv_", "rabbitmq_", "gpu")):
        return "needs Triton, RabbitMQ or a GPU"
    return "nothing of this kind happened"


def render(prom: str, start: float, end: float, out: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(18, 3.1 * rows))
    for ax, panel in zip(axes.flat, panels, strict=False):
        unit, scale = UNITS.get(panel["fieldConfig"]["defaults"].get("unit", ""), ("", 1.0))
        drawn = 0
        for target in panel["targets"]:
            for series in query_range(prom, target["expr"], start, end)[:8]:
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) * scale for _, v in series["values"]]
                if panel["type"] == "heatmap":
                    label = f"≤ {series['metric'].get('le', '?')}"
                else:
                    label = legend(target.get("legendFormat", ""), series["metric"])
                ax.plot(xs, ys, label=label[:28], linewidth=1.2)
                drawn += 1
        ax.set_title(panel["title"] + (f" ({unit})" if unit else ""), fontsize=10)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=6, loc="upper left")
        else:
            ax.text(
                0.5,
                0.5,
                f"no data in this run\n({why_empty(panel)})",
                ha="center",
                va="center",
                transform=ax.transAxes,
                fontsize=8,
                color="gray",
            )
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(
        "Inference gateway dashboard: embedded EfficientNet-Lite0, 2 cores, clients 1 -> 4 -> 16 -> 32 "
        "(x axis: seconds)",
        fontsize=12,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.975))
    fig.savefig(out, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    parser.add_argument("--phase-seconds", type=float, default=20.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_gateway(["--max-batch-size", "16"], Path(tempfile.gettempdir()) / "gateway-bench-models")
        web = free_port()
        shutil.copytree(ROOT / "deploy" / "prometheus" / "rules", Path(tmp) / "rules")
        config = Path(tmp) / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\nrule_files: [rules/*.yml]\n"
            f"scrape_configs: [{{job_name: gateway, static_configs: [{{targets: ['{url.split('//')[1]}']}}]}}]\n"
        )
        prometheus = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp}/data",
                f"--web.listen-address=127.0.0.1:{web}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(3)
            start = time.time()
            phases = [(c, args.phase_seconds) for c in (1, 4, 16, 32)]
            asyncio.run(drive(url, phases))
            time.sleep(3)
            render(f"http://127.0.0.1:{web}", start, time.time(), args.out)
        finally:
            prometheus.terminate()
            prometheus.wait(timeout=30)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    print(args.out)


if __name__ == "__main__":
    main()
