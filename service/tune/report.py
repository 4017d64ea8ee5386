"""What ``gateway tune`` leaves behind: the env file of the chosen settings, and a report folder
(``report.md`` with every candidate and why the winner won, ``candidates.csv``, ``chosen.json``, and
``tune.png``, throughput against p99 for every candidate, when matplotlib is installed)."""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from dotenv import dotenv_values

from service.tune.search import Target, Trial, chosen


def write_env(
    path: Path, winner: Trial, target: Target, base: Mapping[str, str], report: Path, triton_config: Path | None = None
) -> None:
    """``GATEWAY_*=value`` lines: the backend it was tuned against, then the tuned settings. Triton's
    settings live in its repository (``triton_config``, already rewritten); a comment names them."""
    best = winner.best(target)
    assert best is not None
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ")
    lines = [
        f"# gateway tune, {when}: p99 <= {target.slo_p99_ms:g} ms (tuned against {target.p99_ms:g} ms)",
        f"# measured: {best.throughput:.0f} img/s at {best.concurrency} concurrent clients, "
        f"p50 {best.p50_ms:.1f} ms, p99 {best.p99_ms:.1f} ms ({winner.seconds:g} s per level)",
        f"# report: {report}",
    ]
    server = winner.candidate.server()
    if server and triton_config is not None:
        lines.append(
            f"# Triton, written to {triton_config}: " + ", ".join(f"{name} {value}" for name, value in server.items())
        )
    if base:
        lines.append("# the backend it was tuned against")
        lines += [f"{name}={value}" for name, value in sorted(base.items())]
        lines.append("# tuned")
    lines += [f"{name}={value}" for name, value in winner.candidate.env().items()]
    path.write_text("\n".join(lines) + "\n")


def read_env(path: Path) -> dict[str, str]:
    """The ``NAME=value`` pairs of an env file, read as docker compose and shells read it."""
    return {name: value for name, value in dotenv_values(path).items() if value is not None}


def _or_blank(value: int | None) -> str:
    return "" if value is None else str(value)


def _cells(trial: Trial, target: Target, triton: bool) -> list[str]:
    c = trial.candidate
    best = trial.best(target)
    if trial.error:
        verdict = f"error: {trial.error}"
    elif best is None:
        lowest = min((level.p99_ms for level in trial.levels), default=float("inf"))
        verdict = (
            f"misses: p99 {lowest:.1f} ms at {trial.levels[0].concurrency} client(s)" if trial.levels else "no runs"
        )
    elif best.throughput < target.min_throughput:
        verdict = f"below --min-throughput {target.min_throughput:g}"
    else:
        verdict = "meets"
    shown = best or (trial.levels[0] if trial.levels else None)
    figures = (
        [str(shown.concurrency), f"{shown.throughput:.0f}", f"{shown.p50_ms:.1f}", f"{shown.p99_ms:.1f}"]
        if shown
        else ["", "", "", ""]
    )
    mark = "**chosen**" if trial.chosen else ""
    return [
        trial.stage,
        c.policy,
        str(c.batch),
        f"{c.delay_ms:g}",
        str(c.inflight),
        str(c.workers),
        *([_or_blank(c.triton_instances), _or_blank(c.triton_delay_us)] if triton else []),
        *figures,
        verdict,
        mark,
    ]


def _header(triton: bool) -> list[str]:
    return [*HEADER[:6], *(["Triton instances", "Triton delay us"] if triton else []), *HEADER[6:]]


HEADER = [
    "stage",
    "policy",
    "batch",
    "delay ms",
    "in-flight",
    "workers",
    "clients",
    "img/s",
    "p50 ms",
    "p99 ms",
    "verdict",
    "",
]


def write_report(
    folder: Path,
    trials: Sequence[Trial],
    target: Target,
    context: Mapping[str, str],
    env_file: Path | None,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    triton = any(t.candidate.server() for t in trials)
    with (folder / "candidates.csv").open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(
            [
                "stage",
                "policy",
                "batch",
                "delay_ms",
                "inflight",
                "workers",
                "triton_instances",
                "triton_delay_us",
                "seconds",
                "clients",
                "img_s",
                "p50_ms",
                "p99_ms",
                "failure_share",
                "chosen",
            ]
        )
        for t in trials:
            c = t.candidate
            for level in t.levels:
                writer.writerow(
                    [
                        t.stage,
                        c.policy,
                        c.batch,
                        c.delay_ms,
                        c.inflight,
                        c.workers,
                        _or_blank(c.triton_instances),
                        _or_blank(c.triton_delay_us),
                        t.seconds,
                        level.concurrency,
                        f"{level.throughput:.1f}",
                        f"{level.p50_ms:.2f}",
                        f"{level.p99_ms:.2f}",
                        f"{level.failure_share:.4f}",
                        int(t.chosen),
                    ]
                )
    winner = chosen(trials)
    best = winner.best(target) if winner else None
    if winner is not None and best is not None:  # for scripts: what was chosen, and the load it was measured at
        (folder / "chosen.json").write_text(
            json.dumps(
                {
                    "settings": winner.candidate.env(),
                    "triton": winner.candidate.server(),
                    "level": dataclasses.asdict(best),
                },
                indent=2,
            )
            + "\n"
        )
    plotted = _plot(folder / "tune.png", trials, target)
    lines = ["# gateway tune", ""]
    lines += [f"- {name}: {value}" for name, value in context.items()]
    lines += [
        f"- target: p99 <= {target.slo_p99_ms:g} ms, judged against {target.p99_ms:g} ms "
        f"(headroom {target.headroom:g}) with at most {100 * target.max_failure_share:g} % of requests failed"
        + (f", at least {target.min_throughput:g} img/s" if target.min_throughput else ""),
        f"- candidates measured: {len({t.candidate for t in trials})} in {len(trials)} runs",
        "",
        "## Outcome",
        "",
        *_why(trials, target, env_file),
        "",
        "## Every run",
        "",
        "Figures are the candidate's best level: the most throughput with p99 within the target "
        "(or, for one that missed, its first level).",
        "",
        "| " + " | ".join(_header(triton)) + " |",
        "|" + "---|" * len(_header(triton)),
    ]
    lines += ["| " + " | ".join(_cells(t, target, triton)) + " |" for t in trials]
    if plotted:
        lines += ["", "![throughput against p99 for every candidate](tune.png)"]
    report = folder / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def _why(trials: Sequence[Trial], target: Target, env_file: Path | None) -> list[str]:
    winner = chosen(trials)
    if winner is None:
        return [
            "No candidate met the target in its final run, so no settings were written. Loosen the "
            "SLO, lower --min-throughput, or give the backend more capacity; the table shows how "
            "close each candidate came."
        ]
    best = winner.best(target)
    assert best is not None
    finals = [t for t in trials if t.stage.startswith("final") and t.stage == winner.stage and t is not winner]
    why = [
        f"Chosen: **{winner.candidate.label}**, {best.throughput:.0f} img/s at {best.concurrency} "
        f"concurrent clients with p99 {best.p99_ms:.1f} ms (p50 {best.p50_ms:.1f} ms), in the last "
        f"round of re-measurement ({winner.seconds:g} s per level).",
    ]
    if finals:
        runner_up = max(finals, key=lambda t: t.score(target))
        other = runner_up.best(target)
        if other is not None:
            why.append(
                f"It beat {runner_up.candidate.label} ({other.throughput:.0f} img/s, p99 {other.p99_ms:.1f} ms) "
                f"in the same round: {best.throughput / max(other.throughput, 1e-9):.2f}x its throughput."
            )
    why.append(f"Settings written to `{env_file}`." if env_file else "")
    server = winner.candidate.server()
    if server:
        why.append(
            "Triton's settings ("
            + ", ".join(f"{name} {value}" for name, value in server.items())
            + ") written to the model's config.pbtxt in its repository and loaded; `config.pbtxt` and "
            "`config.pbtxt.before` beside this report are the file after and before the tune."
        )
    return [line for line in why if line]


def _plot(path: Path, trials: Sequence[Trial], target: Target) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for t in trials:
        if not t.levels:
            continue
        xs = [level.p99_ms for level in t.levels]
        ys = [level.throughput for level in t.levels]
        if t.chosen:
            ax.plot(xs, ys, "-o", color="tab:red", linewidth=2.5, zorder=3, label=f"chosen: {t.candidate.label}")
            best = t.best(target)
            if best is not None:
                ax.plot([best.p99_ms], [best.throughput], "*", color="tab:red", markersize=18, zorder=4)
        else:
            ax.plot(xs, ys, "-o", color="tab:gray" if t.stage != "coarse" else "tab:blue", alpha=0.4, markersize=3)
    ax.axvline(target.slo_p99_ms, color="black", linestyle="--", label=f"SLO {target.slo_p99_ms:g} ms")
    ax.axvline(target.p99_ms, color="black", linestyle=":", label=f"tuned against {target.p99_ms:g} ms")
    ax.set_xscale("log")
    ax.set_xlabel("p99 latency (ms, log scale)")
    ax.set_ylabel("throughput (img/s)")
    ax.set_title("gateway tune: every candidate's client sweep")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
