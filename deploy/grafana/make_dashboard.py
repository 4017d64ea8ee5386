"""Writes deploy/grafana/dashboards/gateway.json: the dashboard an operator tunes the gateway by.

    python deploy/grafana/make_dashboard.py          (a test checks the committed file is current)

Every query names series that the gateway, its workers, Triton or RabbitMQ export; a test checks
them against real exports (GPU series against Triton's documented names, as no GPU is in CI).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
TRAFFIC = (
    'route!~"/healthz|/readyz|/metrics|/v2/health/.+|/v2/models/.+/(ready|config|stats)|/v2/models/stats'
    '|/v2/repository/.+|/v1/models/.+/(load|unload)"'
)
"""Every route clients call for inference, by its template (bounded): not the probes, /metrics, the
protocol's configuration, statistics and repository routes, or the admin routes; the same selection
as deploy/prometheus/rules/gateway.yml's error ratio and latency."""
GRPC_TRAFFIC = 'method!~"ServerLive|ServerReady|ModelReady|ModelConfig|ModelStatistics|Repository.+"'
"""The gRPC front's counterpart (by method: the RPC's name): not the health methods, configuration,
statistics or the repository, the same selection as the rules' gRPC error ratio and latency."""
GRPC_FAILED = 'code=~"INTERNAL|UNAVAILABLE|DEADLINE_EXCEEDED|UNKNOWN|DATA_LOSS"'
"""The codes of the gateway's own failures, as 5xx is for HTTP (the rules' gRPC error ratio)."""
GRPC_LATENCY = f'{GRPC_TRAFFIC},method!="ModelStreamInfer",code="OK"'
"""gRPC calls whose duration is a latency: a stream's requests one by one, not the stream, which
lasts as long as its client keeps it open; answered OK, as HTTP's latency is of 2xx."""
MODEL = 'model=~"$model"'
"""The dashboard's model selector, on every per-model series."""


def quantiles(metric: str, selector: str = "", by: str = "") -> list[tuple[str, str]]:
    group = f"le{', ' + by if by else ''}"
    return [
        (
            f"p{int(q * 100)}{' {{' + by + '}}' if by else ''}",
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}[5m])))",
        )
        for q in (0.5, 0.95, 0.99)
    ]


BY_VERSION = "model, version"
ROWS: list[tuple[str, list[dict[str, Any]]]] = [
    (
        "Models and versions (a canary is judged here)",
        [
            {
                "title": "Images/s by model and version",
                "unit": "short",
                "targets": [
                    (
                        "{{model}}/{{version}}",
                        f"sum by ({BY_VERSION}) (rate(gateway_images_classified_total{{{MODEL}}}[1m]))",
                    )
                ],
            },
            {
                "title": "Backend call p95 and batcher wait p95 by version",
                "unit": "s",
                "targets": [
                    (
                        f"{stage} {{{{model}}}}/{{{{version}}}}",
                        f"histogram_quantile(0.95, sum by (le, {BY_VERSION}) (rate({metric}_bucket{{{MODEL}}}[5m])))",
                    )
                    for stage, metric in (
                        ("backend", "gateway_backend_duration_seconds"),
                        ("wait", "gateway_queue_wait_seconds"),
                    )
                ],
            },
            {
                "title": "Failed backend calls/s by version",
                "unit": "short",
                "targets": [
                    (
                        "{{model}}/{{version}} {{error}}",
                        f"sum by ({BY_VERSION}, error) (rate(gateway_backend_errors_total{{{MODEL}}}[5m]))",
                    ),
                    ("ready {{model}}/{{version}}", f"min by ({BY_VERSION}) (gateway_backend_ready{{{MODEL}}})"),
                ],
            },
        ],
    ),
    (
        "Throughput",
        [
            {
                "title": "Images/s by mode",
                "unit": "short",
                "targets": [("{{mode}}", f"sum by (mode) (rate(gateway_images_classified_total{{{MODEL}}}[1m]))")],
            },
            {
                "title": "Answers/s by route and status",
                "unit": "reqps",
                "targets": [
                    (
                        "{{route}} {{status}}",
                        f"sum by (route, status) (rate(gateway_http_requests_total{{{TRAFFIC}}}[1m]))",
                    )
                ],
            },
            {
                "title": "gRPC calls/s by method and code",
                "unit": "reqps",
                "targets": [
                    (
                        "{{method}} {{code}}",
                        f"sum by (method, code) (rate(gateway_grpc_requests_total{{{GRPC_TRAFFIC}}}[1m]))",
                    )
                ],
            },
            {
                "title": "Triton inferences/s",
                "unit": "short",
                "targets": [("{{model}}", "sum by (model) (rate(nv_inference_count[1m]))")],
            },
        ],
    ),
    (
        "Latency",
        [
            {
                "title": "Request latency by route (2xx)",
                "unit": "s",
                "targets": quantiles("gateway_http_request_duration_seconds", f'{TRAFFIC},status=~"2.."', "route"),
                "exemplars": True,
            },
            {
                "title": "gRPC latency by method (OK)",
                "unit": "s",
                "targets": quantiles("gateway_grpc_request_duration_seconds", GRPC_LATENCY, "method"),
            },
            {
                "title": "Stage latency, p95",
                "unit": "s",
                "targets": [
                    (stage, f"histogram_quantile(0.95, sum by (le) (rate({metric}_bucket[5m])))")
                    for stage, metric in (
                        ("decode + resize", "gateway_preprocess_duration_seconds"),
                        ("batcher queue", "gateway_queue_wait_seconds"),
                        ("backend call", "gateway_backend_duration_seconds"),
                        ("postprocess", "gateway_postprocess_duration_seconds"),
                    )
                ],
                "exemplars": True,
            },
            {
                # what makes the tail, stage by stage (service/host/stages.py): the stage whose p99 is
                # near the requests' p99 is where to look; loop lag and GC pauses delay every stage
                "title": "Where the p99 goes: each stage's p99",
                "unit": "s",
                "targets": [
                    (
                        "{{stage}}",
                        "histogram_quantile(0.99, sum by (le, stage) (rate(gateway_stage_seconds_bucket[1m])))",
                    )
                ],
            },
            {
                "title": "Triton time per request: queue vs compute",
                "unit": "s",
                "targets": [
                    (
                        f"{part} {{{{model}}}}",
                        f"sum by (model) (rate(nv_inference_{part}_duration_us[1m])) / 1e6 "
                        "/ sum by (model) (rate(nv_inference_request_success[1m]))",
                    )
                    for part in ("queue", "compute_input", "compute_infer", "compute_output")
                ],
            },
        ],
    ),
    (
        "Batching",
        [
            {
                "title": "Batch size distribution (gateway)",
                "type": "heatmap",
                "targets": [("{{le}}", f"sum by (le) (increase(gateway_batch_size_bucket{{{MODEL}}}[1m]))")],
            },
            {
                "title": "Mean batch size",
                "unit": "short",
                "targets": [
                    (
                        "gateway {{model}}/{{version}}",
                        f"sum by (model, version) (rate(gateway_batch_size_sum{{{MODEL}}}[5m])) "
                        f"/ sum by (model, version) (rate(gateway_batch_size_count{{{MODEL}}}[5m]))",
                    ),
                    (
                        "triton {{model}}",
                        "sum by (model) (rate(nv_inference_count[5m])) "
                        "/ sum by (model) (rate(nv_inference_exec_count[5m]))",
                    ),
                ],
            },
            {
                "title": "Batcher queue and in-flight batches",
                "unit": "short",
                "targets": [
                    ("queued images {{model}}/{{version}} {{instance}}", f"gateway_batcher_queue_depth{{{MODEL}}}"),
                    (
                        "in-flight batches {{model}}/{{version}} {{instance}}",
                        f"gateway_batcher_inflight_batches{{{MODEL}}}",
                    ),
                    ("Triton pending {{model}}", "sum by (model) (nv_inference_pending_request_count)"),
                ],
            },
        ],
    ),
    (
        "Adaptive batching (GATEWAY_BATCH_POLICY=adaptive)",
        [
            {
                "title": "Learned batch time: a per image, b per call",
                "unit": "s",
                "targets": [("{{term}} {{instance}}", "gateway_batch_model_seconds")],
            },
            {
                "title": "Batch time: actual / predicted (p10, p50, p90)",
                "unit": "short",
                "targets": [
                    (
                        f"p{int(q * 100)}",
                        f"histogram_quantile({q}, sum by (le) (rate(gateway_batch_prediction_ratio_bucket[5m])))",
                    )
                    for q in (0.1, 0.5, 0.9)
                ],
            },
            {
                "title": "Arrivals and the batch size waited for",
                "unit": "short",
                "targets": [
                    (
                        "images/s {{model}}/{{version}}",
                        "sum by (model, version) (rate(gateway_batcher_arrivals_total[1m]))",
                    ),
                    ("target batch {{instance}}", "gateway_batch_target_size"),
                    (
                        "refused: deadline unmeetable /s",
                        'sum(rate(gateway_rejections_total{reason="deadline_unmeetable"}[1m]))',
                    ),
                ],
            },
        ],
    ),
    (
        "Offline (RabbitMQ)",
        [
            {
                "title": "Backlog",
                "unit": "short",
                "targets": [
                    ("{{queue}}", "max by (queue) (gateway_queue_depth_messages)"),
                    ("ready in RabbitMQ", "sum(rabbitmq_queue_messages_ready)"),
                ],
            },
            {
                "title": "Queue events/s",
                "unit": "short",
                "targets": [("{{event}}", "sum by (event) (rate(gateway_queue_messages_total[1m]))")],
            },
            {
                "title": "Webhook deliveries/s and p95 delay",
                "unit": "short",
                "targets": [
                    ("{{outcome}}", "sum by (outcome) (rate(gateway_webhook_deliveries_total[1m]))"),
                    (
                        "p95 job end to delivery (s)",
                        "histogram_quantile(0.95, sum by (le) (rate(gateway_webhook_latency_seconds_bucket[5m])))",
                    ),
                ],
            },
            {
                "title": "RabbitMQ rates",
                "unit": "short",
                "targets": [
                    ("received", "sum(rate(rabbitmq_global_messages_received_total[1m]))"),
                    ("delivered", "sum(rate(rabbitmq_global_messages_delivered_total[1m]))"),
                    ("acknowledged", "sum(rate(rabbitmq_global_messages_acknowledged_total[1m]))"),
                    ("redelivered", "sum(rate(rabbitmq_global_messages_redelivered_total[1m]))"),
                ],
            },
        ],
    ),
    (
        "GPU and processes",
        [
            {
                "title": "GPU utilisation",
                "unit": "percentunit",
                "targets": [
                    ("triton {{gpu_uuid}}", "nv_gpu_utilization"),
                    ("gateway-visible {{gpu}}", "gateway_gpu_utilization_ratio"),
                ],
            },
            {
                "title": "GPU memory used",
                "unit": "bytes",
                "targets": [
                    ("used {{gpu_uuid}}", "nv_gpu_memory_used_bytes"),
                    ("total {{gpu_uuid}}", "nv_gpu_memory_total_bytes"),
                ],
            },
            {
                "title": "CPU per process",
                "unit": "percentunit",
                "targets": [
                    ("{{job}} {{instance}}", "rate(process_cpu_seconds_total[1m])"),
                    ("triton host", "nv_cpu_utilization"),
                ],
            },
            {
                "title": "Resident memory per process",
                "unit": "bytes",
                "targets": [
                    ("{{job}} {{instance}}", "process_resident_memory_bytes"),
                    ("triton host used", "nv_cpu_memory_used_bytes"),
                ],
            },
        ],
    ),
    (
        "Errors and health",
        [
            {
                "title": "5xx share by route, gRPC failures by method, failed batches by version",
                "unit": "percentunit",
                "targets": [
                    (
                        "{{route}}",
                        f'sum by (route) (rate(gateway_http_requests_total{{{TRAFFIC},status=~"5.."}}[5m])) '
                        f"/ sum by (route) (rate(gateway_http_requests_total{{{TRAFFIC}}}[5m]))",
                    ),
                    (
                        "gRPC {{method}}",
                        f"sum by (method) (rate(gateway_grpc_requests_total{{{GRPC_TRAFFIC},{GRPC_FAILED}}}[5m])) "
                        f"/ sum by (method) (rate(gateway_grpc_requests_total{{{GRPC_TRAFFIC}}}[5m]))",
                    ),
                    (
                        "failed batches {{model}}/{{version}}",
                        f"sum by ({BY_VERSION}) (rate(gateway_backend_errors_total{{{MODEL}}}[5m])) "
                        f"/ sum by ({BY_VERSION}) (rate(gateway_batch_size_count{{{MODEL}}}[5m]))",
                    ),
                ],
            },
            {
                "title": "Rejections by reason",
                "unit": "reqps",
                "targets": [("{{reason}}", "sum by (reason) (rate(gateway_rejections_total[1m]))")],
            },
            {
                "title": "Backend errors",
                "unit": "short",
                "targets": [
                    ("gateway {{error}}", "sum by (error) (rate(gateway_backend_errors_total[1m]))"),
                    ("triton {{reason}}", "sum by (reason) (rate(nv_inference_request_failure[1m]))"),
                ],
            },
            {
                "title": "Backend ready",
                "type": "stat",
                "targets": [("{{backend}} {{instance}}", "gateway_backend_ready")],
            },
        ],
    ),
]


def build() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y, next_id = 0, 1
    for row_title, row_panels in ROWS:
        panels.append(
            {
                "type": "row",
                "title": row_title,
                "id": next_id,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id, y = next_id + 1, y + 1
        width = 24 // len(row_panels)
        for i, spec in enumerate(row_panels):
            panel: dict[str, Any] = {
                "id": next_id,
                "type": spec.get("type", "timeseries"),
                "title": spec["title"],
                "datasource": DATASOURCE,
                "gridPos": {"h": 8, "w": width, "x": i * width, "y": y},
                "fieldConfig": {"defaults": {"unit": spec.get("unit", "short")}, "overrides": []},
                "targets": [
                    {
                        "refId": chr(ord("A") + j),
                        "datasource": DATASOURCE,
                        "expr": expr,
                        "legendFormat": legend,
                        **({"format": "heatmap"} if spec.get("type") == "heatmap" else {}),
                        # dots for sampled requests, each linking to its trace (tracing on)
                        **({"exemplar": True} if spec.get("exemplars") else {}),
                    }
                    for j, (legend, expr) in enumerate(spec["targets"])
                ],
            }
            panels.append(panel)
            next_id += 1
        y += 8
    return {
        "uid": "inference-gateway",
        "title": "Inference gateway",
        "tags": ["inference", "triton", "gateway"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "model",
                    "label": "model",
                    "type": "query",
                    "datasource": DATASOURCE,
                    "definition": "label_values(gateway_images_classified_total, model)",
                    "query": {"query": "label_values(gateway_images_classified_total, model)", "refId": "models"},
                    "refresh": 2,
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                }
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("dashboards") / "gateway.json"
    out.write_text(json.dumps(build(), indent=2) + "\n")
    print(out)


if __name__ == "__main__":
    main()
