"""Offline mode's commands: ``gateway worker``, ``gateway ingest``, ``gateway queues policies`` and
``gateway alive`` (a worker's liveness probe)."""

from __future__ import annotations

import argparse
import sys

from service.cli.common import load_settings, logging_config
from service.host import eventloop


def worker(args: argparse.Namespace) -> int:
    from service.jobs.worker import run_worker
    from service.serving.catalog import CatalogError

    settings = load_settings(args, serves=True)
    logging_config(settings)
    try:
        eventloop.run(run_worker(settings))
    except CatalogError as exc:
        sys.exit(f"gateway worker: invalid settings:\n{exc}")
    return 0


def ingest(args: argparse.Namespace) -> int:
    from service.jobs.ingest import run_ingest

    settings = load_settings(args)
    logging_config(settings)
    return eventloop.run(
        run_ingest(
            settings,
            args.paths,
            args.out,
            top_k=args.top_k,
            max_outstanding=args.max_outstanding,
            resend_after=args.resend_after,
            model=args.target_model,
            version=args.model_version,
            connect_timeout=args.connect_timeout or None,
        )
    )


def queue_policies(args: argparse.Namespace) -> int:
    import asyncio

    from service.jobs.policies import apply, gateway_policies, shell_lines
    from service.jobs.topology import Names

    settings = load_settings(args)
    policies = gateway_policies(
        Names(settings.queue_prefix),
        settings.queue_delivery_limit,
        idempotency_ttl=settings.idempotency_ttl,
        ingest_ttl=settings.ingest_results_ttl,
    )
    if args.apply is None:
        print(shell_lines(policies, args.vhost))
        return 0
    asyncio.run(apply(args.apply, policies, args.vhost))
    print(f"applied {len(policies)} policies: {', '.join(p.name for p in policies)}")
    return 0


def alive(args: argparse.Namespace) -> int:
    """Liveness probe of a worker: 0 when its event loop touched the heartbeat file recently."""
    from service.jobs.worker import heartbeat_age

    path = args.file or load_settings(args).worker_heartbeat_file
    if path is None:
        sys.exit(
            "gateway alive: no heartbeat file to check: GATEWAY_WORKER_HEARTBEAT_FILE is empty and no --file was "
            "given; set either to the file the worker touches (the worker's default: "
            "$TMPDIR/gateway-worker.heartbeat)"
        )
    if path.is_dir():  # other processes change a directory's time: it proves nothing about the loop
        sys.exit(f"gateway alive: {path} is a directory, not the worker's heartbeat file")
    age = heartbeat_age(path)
    if age == float("inf"):
        print(
            f"not alive: {path} does not exist: the worker has not started, or it writes another file "
            "(GATEWAY_WORKER_HEARTBEAT_FILE and TMPDIR must be the worker's)",
            file=sys.stderr,
        )
        return 1
    if age > args.max_age:
        print(f"not alive: {path} last touched {age:.0f} s ago (limit {args.max_age:g} s)", file=sys.stderr)
        return 1
    return 0
