"""Command line: ``gateway [serve]``, ``gateway worker``, ``gateway models fetch|build|list|...``.

Every setting is a flag of ``serve`` (``--max-batch-size 32`` for ``GATEWAY_MAX_BATCH_SIZE``);
flags override the environment.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from service import __version__
from service.cli import models as models_commands
from service.cli import offline as offline_commands
from service.cli import serve as serve_commands
from service.cli.common import load_settings, number
from service.cli.flags import GROUPS, Parser, add_setting_flags


def _tune(args: argparse.Namespace) -> int:
    from service.tune.command import run

    return run(args, load_settings(args))


def _check(args: argparse.Namespace) -> int:
    from service.cli.check import check

    return check(args)


WORKER_GROUPS = tuple(GROUPS)
"""A worker runs every part of serving but HTTP: its metrics listen on ``--host``, its models run on
any backend (the GPU's too), its jobs need the offline and security settings."""
ENGINE_GROUPS = ("server", "models", "backends", "GPU", "batching", "limits", "observability")
MODEL_GROUPS = ("models", "a model of your own", "backends", "GPU", "batching", "limits")
"""The settings each command uses, by concern (``service.cli.flags.GROUPS``); serve and tune: all."""


def _settings_reference(args: argparse.Namespace) -> int:
    if args.effective:
        from pydantic import ValidationError

        from service.cli.flags import effective
        from service.settings.reference import explain

        try:
            rows = effective(args)
        except ValidationError as exc:
            sys.exit(f"gateway: invalid settings:\n{explain(exc)}")
        width = max(len(variable) for variable, _, _ in rows)
        for variable, value, source in rows:
            print(f"{variable:<{width}}  {source:<11}  {value}")
        return 0
    if args.cli_reference:
        from service.cli.reference import cli_reference

        print(cli_reference(build_parser()), end="")
        return 0
    from service.settings.reference import reference

    print(reference(), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="gateway", description="Async inference gateway.")
    parser.add_argument("--version", action="version", version=f"gateway {__version__}")
    commands = parser.add_subparsers(dest="command")
    serve = commands.add_parser("serve", help="run the HTTP gateway (the default command)")
    add_setting_flags(serve)
    serve.set_defaults(func=serve_commands.serve)
    worker = commands.add_parser("worker", help="consume queued images from RabbitMQ and publish results")
    add_setting_flags(worker, WORKER_GROUPS)
    worker.set_defaults(func=offline_commands.worker)
    engine = commands.add_parser(
        "engine", help="the process that owns the GPU for serve's workers (GATEWAY_TORCH_ENGINE=shared)"
    )
    add_setting_flags(engine, ENGINE_GROUPS)
    engine.add_argument("--socket", required=True, help="Unix socket the workers connect to")
    engine.add_argument(
        "--ready-fd", type=int, default=None, help="a pipe's fd to write one byte to once listening (gateway serve's)"
    )
    engine.add_argument(
        "--parent-fd",
        type=int,
        default=None,
        help=(
            "a pipe's fd whose end-of-file means the process that started the engine is gone or stopping:"
            " the engine stops (with it, the engine ignores SIGTERM and SIGINT)"
        ),
    )
    engine.set_defaults(func=serve_commands.engine)
    queues = commands.add_parser("queues", help="RabbitMQ set-up for offline mode")
    queue_commands = queues.add_subparsers(dest="queues_command", required=True)
    policies = queue_commands.add_parser(
        "policies", help="print the queue policies as rabbitmqctl commands, or apply them (--apply)"
    )
    add_setting_flags(policies, ("offline",))
    policies.add_argument("--apply", metavar="URL", help="management API, e.g. http://user:pass@rabbitmq:15672")
    policies.add_argument("--vhost", default="/", help="virtual host (default /)")
    policies.set_defaults(func=offline_commands.queue_policies)
    alive = commands.add_parser("alive", help="worker liveness probe: exit 1 when its event loop is stuck")
    alive.add_argument("--file", type=Path, default=None, help="heartbeat file (default: the worker's setting)")
    alive.add_argument(
        "--max-age",
        type=number(0.001, 86400.0),
        default=30.0,
        help="seconds without a heartbeat that mean stuck (up to a day)",
    )
    alive.set_defaults(func=offline_commands.alive)
    reference = commands.add_parser(
        "settings",
        help="print the settings reference (docs/settings.md's table), the settings in effect (--effective) "
        "or the command-line reference (--cli-reference: docs/cli.md)",
    )
    shown = reference.add_mutually_exclusive_group()
    shown.add_argument(
        "--effective",
        action="store_true",
        help="the settings a process would run with here, each with where its value came from (flag, environment, "
        "default); secrets masked. Give the process's flags after it",
    )
    shown.add_argument("--cli-reference", action="store_true", help="every command and its flags, as docs/cli.md")
    add_setting_flags(reference)
    reference.set_defaults(func=_settings_reference)
    ingest = commands.add_parser("ingest", help="classify a folder of photos through RabbitMQ into JSON lines")
    # --model is ingest's own (the jobs' model), not the served model's setting
    add_setting_flags(ingest, ("models", "offline", "limits", "observability"), skip=frozenset({"model"}))
    ingest.add_argument("paths", nargs="+", type=Path, help="image files or folders (searched recursively)")
    ingest.add_argument("--out", type=Path, required=True, help="results file (JSON lines); re-runs resume it")
    ingest.add_argument("--top-k", type=int, default=5, choices=range(1, 21), metavar="1-20")
    ingest.add_argument(
        "--max-outstanding",
        type=number(1, 65535, integer=True),
        default=256,
        help="publishes awaiting a broker confirm (1-65535)",
    )
    ingest.add_argument(
        "--resend-after",
        type=number(0.001, 7 * 86400.0),
        default=120.0,
        help="seconds without any new result before unfinished images are published again (up to a week)",
    )
    ingest.add_argument(
        "--model",
        dest="target_model",
        metavar="NAME",
        help="the model the jobs are for, one the models setting or file names (default: the default model; "
        "its queue is the one its workers take: see docs/routing.md)",
    )
    ingest.add_argument(
        "--connect-timeout",
        type=number(0.0, 7 * 86400.0),
        default=30.0,
        metavar="SECONDS",
        help="how long to wait for the first connection to the broker before giving up with exit status 69 "
        "(0: for ever); Ctrl-C or SIGTERM stops a run with exit status 130, and the same command resumes it",
    )
    ingest.add_argument(
        "--model-version",
        metavar="VERSION",
        help="the version of --model the jobs are for (default: the workers pick one by the traffic weights)",
    )
    ingest.set_defaults(func=offline_commands.ingest)
    tune = commands.add_parser(
        "tune",
        help="search the batching settings for the most throughput within a p99 target; write them as an env file",
    )
    add_setting_flags(tune)
    from service.tune.command import add_arguments

    add_arguments(tune)
    tune.set_defaults(func=_tune)
    models = commands.add_parser("models", help="fetch checkpoints, build or list the cached ONNX models")
    model_commands = models.add_subparsers(dest="models_command", required=True)
    fetch = model_commands.add_parser(
        "fetch",
        help="download a model's published checkpoint (URL and SHA-256 pinned), verify it, and build the model "
        "from it; it becomes the model's default weights",
    )
    add_setting_flags(fetch, MODEL_GROUPS)
    fetch.add_argument("model", nargs="?", default=None, help="e.g. resnet50 (default: the configured model)")
    fetch.add_argument("--url", default=None, help="a mirror of the checkpoint (the pinned SHA-256 is still checked)")
    fetch.add_argument("--sha256", default=None, help="a checkpoint of one's own: the SHA-256 it must have")
    fetch.add_argument("--triton-repo", type=Path, default=None, help="also write a Triton repository here")
    fetch.add_argument("--variant", choices=["tensorrt", "onnxruntime", "openvino", "python"], default="onnxruntime")
    fetch.set_defaults(func=models_commands.fetch)
    build = model_commands.add_parser("build", help="build the configured model's ONNX file (or --all)")
    add_setting_flags(build, MODEL_GROUPS)
    build.add_argument("--all", action="store_true", help="build every known model")
    build.add_argument("--force", action="store_true", help="rebuild even when the cached file is current")
    build.set_defaults(func=models_commands.build)
    repo = model_commands.add_parser("triton-repo", help="write a Triton model repository for the model (or --all)")
    add_setting_flags(repo, MODEL_GROUPS)
    repo.add_argument("--out", type=Path, required=True, help="repository folder to write into")
    repo.add_argument(
        "--variant",
        choices=["tensorrt", "onnxruntime", "openvino", "python"],
        default="python",
        help="tensorrt (GPU; plan built by build_plan.sh), onnxruntime, openvino (CPU hosts), or python (CPU hosts, "
        "and the tritonserver of PyPI's pytriton wheel)",
    )
    repo.add_argument("--all", action="store_true", help="every known model")
    repo.add_argument("--config-only", action="store_true", help="write configuration files, not the ONNX file")
    repo.add_argument("--triton-max-batch-size", type=int, default=64)
    repo.add_argument("--triton-preferred", default="8,16,32", help="preferred batch sizes, comma-separated")
    repo.add_argument("--triton-queue-delay-us", type=int, default=2000)
    repo.add_argument(
        "--triton-max-queue-size",
        type=int,
        default=0,
        help="Triton's per-model queue bound (0: none; see deploy/triton/README.md on Triton 2.51's queue policy)",
    )
    repo.add_argument("--triton-instances", type=int, default=1, help="model instances (per GPU)")
    repo.add_argument("--triton-kind", choices=["gpu", "cpu"], default=None)
    repo.add_argument(
        "--triton-intra-op-threads", type=int, default=0, help="python and openvino variants: runtime threads"
    )
    repo.add_argument("--triton-no-bf16", action="store_true", help="openvino variant: fp32 kernels only")
    repo.add_argument(
        "--triton-no-tensorrt",
        action="store_true",
        help="onnxruntime variant on GPU: CUDA only, without the TensorRT accelerator (on by default, FP16)",
    )
    repo.add_argument(
        "--triton-engine-cache",
        default="/engine-cache",
        help="onnxruntime variant on GPU: where Triton keeps TensorRT engines (mount a volume there)",
    )
    repo.set_defaults(func=models_commands.triton_repo)
    quantize = model_commands.add_parser(
        "quantize", help="build the model's INT8 version for the openvino backend, calibrated on photos"
    )
    add_setting_flags(quantize, MODEL_GROUPS)
    quantize.add_argument(
        "--photos",
        type=Path,
        required=True,
        help="folder of photos like the traffic (at least 32; searched recursively)",
    )
    quantize.add_argument("--force", action="store_true", help="quantize again even when the cached model is current")
    quantize.set_defaults(func=models_commands.quantize)
    checking = model_commands.add_parser(
        "check",
        help="try a model of your own before serving it: what its file says, what the declaration adds, "
        "and its answers for photos",
    )
    add_setting_flags(checking, MODEL_GROUPS, skip=frozenset({"model_path"}))
    checking.add_argument("model_path", type=Path, metavar="PATH", help="the model file (.onnx, or an IR .xml)")
    checking.add_argument("--photo", type=Path, action="append", default=[], help="a photo to run (repeatable)")
    checking.add_argument("--top-k", type=int, default=5, choices=range(1, 21), metavar="1-20")
    checking.set_defaults(func=_check)
    listing = model_commands.add_parser("list", help="list the known models and their cache state")
    add_setting_flags(listing, MODEL_GROUPS)
    listing.set_defaults(func=models_commands.list_models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["serve", *argv]
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
