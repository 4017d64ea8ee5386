"""The GPU figures' report (``loadtests.gpu_figures``): ``runs.csv``, ``report.md`` with its
headline and a table per section, and the backend's throughput plot."""

from __future__ import annotations

from pathlib import Path

from loadtests.harness.gpu_runs import Run, write_runs


def _fmt(value: float | None, digits: int = 0) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def write_report(
    out: Path, env: dict[str, str], runs: list[Run], command: str, elapsed: float, gpu_hour_usd: float
) -> None:
    """``runs.csv`` and ``report.md`` (with its plot) in ``out``: the headline, then a table per section."""
    out.mkdir(parents=True, exist_ok=True)
    write_runs(out / "runs.csv", runs)
    lines = [
        "# GPU figures",
        "",
        f"Written by `{command}` in {elapsed / 60:.1f} min.",
        "ResNet-50 with random weights (the same compute as the real one; answers meaningless).",
        "",
        "## Machine",
        "",
        *(f"- {k}: {v}" for k, v in env.items()),
        "",
        *_headline(runs, gpu_hour_usd),
    ]
    sections = [
        ("Backend alone (decoded 224 px tensors in, probabilities out)", "backend"),
        ("Decode alone (JPEG bytes to 224 x 224 RGB)", "decode"),
        ("Gateway end to end (JPEGs in over HTTP, labels out)", "gateway"),
    ]
    for title, section in sections:
        rows = [r for r in runs if r.section == section]
        if not rows:
            continue
        lines += [
            f"## {title}",
            "",
            "| run | img/s | p50 ms | p99 ms | errors | GPU util mean/max/min % | GPU mem GiB | "
            "server cores | server CPU ms/img | client cores | mean batch |",
            "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            util = (
                f"{r.gpu_util_mean:.0f} / {r.gpu_util_max:.0f} / {r.gpu_util_min:.0f}"
                if r.gpu_util_mean is not None and r.gpu_util_max is not None and r.gpu_util_min is not None
                else ""
            )
            lines.append(
                f"| {r.name} | {r.images_per_s:,.0f} | {_fmt(r.p50_ms, 1)} | {_fmt(r.p99_ms, 1)} | {r.errors} | "
                f"{util} | {_fmt(r.gpu_mem_max_gib, 1)} | {_fmt(r.server_cpu_cores, 1)} | "
                f"{_fmt(r.server_cpu_ms_per_image, 3)} | {_fmt(r.client_cpu_cores, 1)} | {_fmt(r.mean_batch, 1)} |"
            )
        lines.append("")
    lines += _poisson_table([r for r in runs if r.section == "poisson"])
    (out / "report.md").write_text("\n".join(lines))
    _plot(out, [r for r in runs if r.section == "backend"])


def _headline(runs: list[Run], gpu_hour_usd: float) -> list[str]:
    """The best closed-loop gateway run against the backend alone in the gateway's own mode (and
    against the best backend run of any mode), and each gateway's highest Poisson rate in bound."""
    backend = [r for r in runs if r.section == "backend"]
    gateway = [r for r in runs if r.section == "gateway"]
    best = max(gateway, key=lambda r: r.images_per_s, default=None)
    lines = []
    if best is not None and best.images_per_s > 0:
        cost = gpu_hour_usd / (best.images_per_s * 3600) * 1e6
        lines.append(
            f"- gateway, end to end: **{best.images_per_s:,.0f} img/s** ({best.name}), GPU utilisation mean "
            f"{_fmt(best.gpu_util_mean)} %, {_fmt(best.server_cpu_ms_per_image, 2)} ms of CPU per image; "
            "gateway / backend alone in the study (docs/study.md): 410/458 = 0.895"
        )
        alike = [r for r in backend if r.config.get("mode") == best.config.get("mode")]
        for what, rows in ((f"in the gateway's mode ({best.config.get('mode')})", alike), ("any mode", backend)):
            top = max(rows, key=lambda r: r.images_per_s, default=None)
            if top is not None and top.images_per_s > 0:
                lines.append(
                    f"- backend alone, {what}: {top.images_per_s:,.0f} img/s ({top.name}); the gateway: "
                    f"**{best.images_per_s / top.images_per_s:.3f}x**"
                )
        lines.append(
            f"- cost per million images at ${gpu_hour_usd:.2f} per GPU-hour (an assumed price; the whole "
            f"machine's other costs not counted): **${cost:.3f}**"
        )
    elif backend:
        top = max(backend, key=lambda r: r.images_per_s)
        lines.append(f"- backend alone: **{top.images_per_s:,.0f} img/s** ({top.name})")
    searches = [r for r in runs if r.section == "poisson"]
    for r in searches:
        if r.config.get("ceiling"):
            tried = [t for t in searches if t.config.get("gateway") == r.config["gateway"] and not t.config["ceiling"]]
            best_rate, lowest = r.config["highest_rate_within_p99"], min(tried, key=lambda t: t.config["offered_rate"])
            found = (
                f"**{best_rate:,.0f} img/s**"
                if best_rate
                else f"**none of the rates tried** (the lowest, {lowest.config['offered_rate']:,.0f}/s: "
                f"p99 {_fmt(lowest.p99_ms, 1)} ms)"
            )
            lines.append(
                f"- {r.config['gateway']}: highest Poisson rate with p99 <= {r.config['p99_bound_ms']:g} ms: {found} "
                f"(the generator alone: {r.images_per_s:,.0f}/s)"
            )
    return ["## Headline", "", *lines, ""] if lines else []


def _poisson_table(rows: list[Run]) -> list[str]:
    """Open-loop runs: latency from each request's scheduled time, so a stalled server's backlog
    counts; the generator's own ceiling (a trivial server, closed loop) after each search."""
    if not rows:
        return []
    lines = [
        "## Poisson arrivals (one 224 px image per request, open loop)",
        "",
        "| gateway | offered /s | answered /s | p50 ms | p90 ms | p99 ms | p99.9 ms | errors | sender lag p99 ms | "
        "waited for a connection |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        c = r.config
        offered = "ceiling (trivial server, closed)" if c.get("ceiling") else f"{c.get('offered_rate') or 0:,.0f}"
        lines.append(
            f"| {c.get('gateway', r.name)} | {offered} | {r.images_per_s:,.0f} | {_fmt(r.p50_ms, 1)} | "
            f"{_fmt(c.get('p90_ms'), 1)} | {_fmt(r.p99_ms, 1)} | {_fmt(c.get('p99_9_ms'), 1)} | {r.errors} | "
            f"{_fmt(c.get('sender_lag_p99_ms'), 1)} | {c.get('waited_for_a_connection', '')} |"
        )
    return [*lines, ""]


def _plot(out: Path, backend: list[Run]) -> None:
    if not backend:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in sorted({str(r.config.get("mode", "")) for r in backend}):
        for in_flight in sorted({r.in_flight for r in backend if r.in_flight}):
            rows = [r for r in backend if r.in_flight == in_flight and r.config.get("mode", "") == mode]
            sizes, rates = [r.batch or 0 for r in rows], [r.images_per_s for r in rows]
            ax.plot(sizes, rates, marker="o", label=f"{mode}, {in_flight} in flight")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("img/s")
    ax.set_title("ResNet-50 fp16, torch backend alone")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_batch.png", dpi=100)
