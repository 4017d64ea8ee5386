"""The gateway's own stage timings (``gateway_stage_seconds``, ``service.host.stages``) between two
/metrics readings: per stage, how many were counted and the bucket bounds of their p50 and p99.

This is what says where a run's tail came from: the stage whose p99 is near the requests' p99."""

from __future__ import annotations

from collections import defaultdict

from loadtests.harness.overload import quantile_bound

STAGE_SERIES = "gateway_stage_seconds_bucket{"


def histogram_buckets(metrics: str, series: str, **labels: str) -> dict[str, dict[float, float]]:
    """Cumulative counts by bucket bound of the histogram ``series`` (``name_bucket{``) in a /metrics
    text, for the lines with every one of ``labels``, keyed by the value of the ``stage`` label
    (``""`` where there is none)."""
    found: dict[str, dict[float, float]] = defaultdict(dict)
    wanted = [f'{name}="{value}"' for name, value in labels.items()]
    for line in metrics.splitlines():
        if not line.startswith(series) or not all(label in line for label in wanted):
            continue
        le = line.split('le="', 1)[1].split('"', 1)[0]
        stage = line.split('stage="', 1)[1].split('"', 1)[0] if 'stage="' in line else ""
        found[stage][float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return dict(found)


def stage_quantiles(before: str, after: str) -> dict[str, dict[str, float]]:
    """Each stage counted between the two readings: ``count``, ``p50_ms`` and ``p99_ms`` (the upper
    bound of the bucket that holds the quantile)."""
    first = histogram_buckets(before, STAGE_SERIES)
    table = {}
    for stage, buckets in histogram_buckets(after, STAGE_SERIES).items():
        earlier = first.get(stage, {})
        count = buckets.get(float("inf"), 0.0) - earlier.get(float("inf"), 0.0)
        if count <= 0:
            continue
        table[stage] = {
            "count": count,
            "p50_ms": 1000 * quantile_bound(buckets, 0.5, earlier),
            "p99_ms": 1000 * quantile_bound(buckets, 0.99, earlier),
        }
    return table


def stage_line(table: dict[str, dict[str, float]]) -> str:
    """``stage p50/p99 ms`` for each stage counted, in the serving path's order."""
    from service.host.stages import STAGES

    return ", ".join(
        f"{stage} {table[stage]['p50_ms']:g}/{table[stage]['p99_ms']:g}" for stage in STAGES if stage in table
    )
