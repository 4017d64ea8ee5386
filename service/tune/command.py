"""``gateway tune``: the composition of the search, the real measurement and the report."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from service.host.cpus import available_cpus
from service.settings import Settings
from service.tune.report import write_env, write_report
from service.tune.search import POLICIES, Candidate, Plan, Space, Target, Trial, chosen, search

if TYPE_CHECKING:
    from service.triton.model_config import TritonModel

TUNED = ("batch_policy", "max_batch_size", "max_delay", "max_inflight_batches", "workers")
"""Settings the search chooses; given as flags to ``tune`` they are ignored."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("images", nargs="+", type=Path, help="photos like the traffic: files or folders (recursive)")
    parser.add_argument("--slo-p99-ms", type=float, required=True, help="the p99 latency target, milliseconds")
    parser.add_argument("--min-throughput", type=float, default=0.0, help="images/s the chosen settings must reach")
    parser.add_argument("--out", type=Path, default=Path("tuned.env"), help="env file to write (default tuned.env)")
    parser.add_argument("--report", type=Path, default=Path("tune-report"), help="report folder (default tune-report)")
    parser.add_argument(
        "--quick", action="store_true", help="shorter runs, a coarser client sweep, one refinement pass"
    )
    parser.add_argument(
        "--headroom",
        type=float,
        default=0.8,
        help="candidates are judged against SLO x headroom, so the choice holds on a noisier day (default 0.8)",
    )
    parser.add_argument("--max-concurrency", type=int, default=64, help="most concurrent clients (default 64)")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64", help="batch sizes to consider")
    parser.add_argument("--delays-ms", default="0,1,2,5,10,20", help="max_delay values to consider, milliseconds")
    parser.add_argument("--inflight", default="1,2,4", help="in-flight batch counts to consider")
    parser.add_argument(
        "--worker-counts", default=None, help="gateway worker processes to consider (default 1, 2, 4... up to the CPUs)"
    )
    parser.add_argument("--policies", default=",".join(POLICIES), help="batch policies to consider")
    parser.add_argument(
        "--served-model",
        default=None,
        help="with several models (GATEWAY_MODELS or GATEWAY_MODELS_FILE): the one to tune, alone, on its own "
        "settings (default: the default model; its version taking the most traffic)",
    )
    triton = parser.add_argument_group(
        "Triton's own settings (with --backend triton; Triton must run with --model-control-mode=explicit)"
    )
    triton.add_argument(
        "--triton-repository",
        type=Path,
        default=None,
        help="the model repository the Triton at --triton-url serves: its config.pbtxt is rewritten and the "
        "model reloaded for each candidate, and left holding the chosen settings",
    )
    triton.add_argument("--triton-instances", default="1,2,4", help="model instances per instance group to consider")
    triton.add_argument(
        "--triton-delays-us", default="0,500,2000", help="Triton's max_queue_delay_microseconds values to consider"
    )


def _ints(text: str) -> tuple[int, ...]:
    return tuple(sorted({int(v) for v in text.split(",") if v.strip()}))


def _space(args: argparse.Namespace, triton: TritonModel | None) -> Space:
    cpus = available_cpus()
    workers = (
        _ints(args.worker_counts) if args.worker_counts else tuple(w for w in (1, 2, 4, 8, 16, 32) if w <= max(cpus, 1))
    )
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    unknown = set(policies) - set(POLICIES)
    if unknown:
        sys.exit(f"gateway tune: unknown batch policies {sorted(unknown)} (known: {', '.join(POLICIES)})")
    space = Space(
        batches=_ints(args.batches),
        delays_ms=tuple(sorted({float(v) for v in args.delays_ms.split(",") if v.strip()})),
        policies=policies,
        inflights=_ints(args.inflight),
        workers=workers,
    )
    if triton is None:
        return space
    current = triton.settings()
    batches = tuple(b for b in space.batches if not current.max_batch_size or b <= current.max_batch_size)
    if not batches:  # the gateway refuses batches larger than Triton's
        sys.exit(f"gateway tune: every --batches value exceeds {triton.name}'s max_batch_size {current.max_batch_size}")
    return replace(
        space,
        batches=batches,
        triton_instances=_ints(args.triton_instances),
        triton_delays_us=_ints(args.triton_delays_us),
        defaults=Candidate(triton_instances=current.instances, triton_delay_us=current.queue_delay_us),
    )


def _triton(args: argparse.Namespace, settings: Settings) -> TritonModel | None:
    from service.backends.capabilities import capabilities_of
    from service.triton.model_config import ReloadRefused, TritonModel

    if args.triton_repository is None:
        return None
    if not capabilities_of(settings).on_triton:
        sys.exit("gateway tune: --triton-repository needs --backend triton (and --triton-url)")
    model = TritonModel(
        args.triton_repository, settings.triton_model or settings.model, settings.triton_url, settings.triton_protocol
    )
    try:
        model.check_tunable(delay=bool(_ints(args.triton_delays_us)))
    except (ReloadRefused, FileNotFoundError) as exc:
        sys.exit(f"gateway tune: {exc}")
    return model


def served_model_env(settings: Settings, name: str | None) -> tuple[str, dict[str, str]] | None:
    """With several models: the model to tune (``name``, or the default) and the environment that
    serves it alone, as its version taking the most traffic runs (its profile, backend and own
    settings, but those the search chooses); None with one model."""
    from service.serving.catalog import CatalogError, load_catalog
    from service.settings.model import ModelSettings

    if settings.models_file is None and not settings.models.strip():
        return None
    try:
        catalog = load_catalog(settings)
    except CatalogError as exc:
        sys.exit(f"gateway tune: {exc}")
    spec = catalog.model(name or catalog.default)
    if spec is None:
        sys.exit(f"gateway tune: no model {name!r}; served: {', '.join(m.name for m in catalog.models)}")
    version = max(spec.versions, key=lambda v: v.traffic)
    env = {"GATEWAY_MODELS_FILE": "", "GATEWAY_MODELS": "", "GATEWAY_MODEL": version.profile.name}
    for key, field in ModelSettings.model_fields.items():
        value = getattr(version.own, key)
        if key in TUNED or value is None or value == field.default:
            continue
        env[f"GATEWAY_{key.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
    return spec.name, env


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Tune against the backend ``settings`` name; 0 when settings meeting the target were written."""
    from service.backends.capabilities import capabilities_of
    from service.jobs.ingest import collect
    from service.tune.runner import GatewayMeasure

    paths = collect(args.images)
    if not paths:
        sys.exit("gateway tune: no images found")
    images = [p.read_bytes() for p in paths[:256]]
    base = {
        f"GATEWAY_{name.upper()}": str(getattr(args, name))
        for name in Settings.model_fields
        if name not in TUNED and getattr(args, name, None) is not None
    }
    served = served_model_env(settings, args.served_model)
    if served is not None:
        base = {**base, **served[1]}
    target = Target(args.slo_p99_ms, args.min_throughput, args.headroom)
    plan = Plan.make(args.quick, min(args.max_concurrency, settings.max_concurrent_requests))
    triton = _triton(args, settings)
    space = _space(args, triton)
    capabilities = capabilities_of(settings)
    context = {
        "backend": f"{capabilities.name} ({settings.model})"
        + (f" at {settings.triton_url} over {settings.triton_protocol}" if capabilities.on_triton else ""),
        **({"Triton repository": f"{triton.path} (rewritten per candidate)"} if triton else {}),
        "images": f"{len(images)} from {', '.join(str(p) for p in args.images)}",
        "client sweep": ", ".join(str(c) for c in plan.concurrency) + " concurrent clients (closed loop)",
        "search": f"{'quick' if args.quick else 'full'}: {plan.screen_seconds:g} s per level to screen, "
        f"{plan.finalists} finalists from {plan.final_seconds:g} s per level, halved each round",
        "CPUs": str(available_cpus()),
        **({"model": f"{served[0]}, alone, on its own settings from the models"} if served else {}),
    }

    def progress(trial: Trial) -> None:
        best = trial.best(target)
        if trial.error:
            outcome = trial.error
        elif best:
            outcome = f"{best.throughput:.0f} img/s at {best.concurrency} clients, p99 {best.p99_ms:.1f} ms"
        else:
            outcome = f"misses the target (p99 {min(level.p99_ms for level in trial.levels):.1f} ms at best)"
        print(f"[{trial.stage}] {trial.candidate.label}: {outcome}", file=sys.stderr, flush=True)

    original = triton.path.read_text() if triton else None
    winner: Trial | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="gateway-tune-") as workdir:
            measure = GatewayMeasure(base, images, target, Path(workdir), triton)
            trials = asyncio.run(search(measure, space, target, plan, progress))
        winner = chosen(trials)
        if triton is not None and winner is not None:
            triton.apply(winner.candidate.triton_instances, winner.candidate.triton_delay_us)
    finally:
        if triton is not None and original is not None:
            args.report.mkdir(parents=True, exist_ok=True)
            (args.report / "config.pbtxt.before").write_text(original)
            if winner is None:  # interrupted, or nothing met the target: as it was
                triton.write(original)
                triton.reload()
            else:
                (args.report / "config.pbtxt").write_text(triton.path.read_text())
    env_file = args.out if winner is not None else None
    report = write_report(args.report, trials, target, context, env_file)
    if winner is None:
        print(f"gateway tune: no candidate met the target; see {report}", file=sys.stderr)
        return 1
    write_env(args.out, winner, target, base, report, triton.path if triton else None)
    if served is not None:  # a model of several: its batcher settings go in its table of the models file
        tuned = winner.candidate
        with args.out.open("a") as out:
            out.write(
                f'# for the models file: [models.{served[0]}] batch_policy = "{tuned.policy}", '
                f"max_batch_size = {tuned.batch}, max_delay = {tuned.delay_ms / 1000:g}, "
                f"max_inflight_batches = {tuned.inflight} (GATEWAY_WORKERS is the whole gateway's)\n"
            )
    print(f"gateway tune: {winner.candidate.label} written to {args.out}; report {report}", file=sys.stderr)
    return 0
