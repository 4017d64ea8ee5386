"""``gateway ingest PATH... --out results.jsonl``: classify a folder of photos through RabbitMQ.

* Publishes every image (each file's absolute path in the ``filename`` header) with at most
  ``max_outstanding`` publishes awaiting their broker confirm, retrying while the broker is away.
* Results come back on a durable queue named after the output file, so results that arrive while
  this command is down (or while the broker restarts) wait for it; each is written as one JSON line
  and flushed before its message is acknowledged.
* Re-running with the same ``--out`` skips the images already in the file: an interrupted run is
  finished without redoing work. The results queue of a run that is never rerun is deleted by the
  broker once unused for ``ingest_results_ttl`` (7 days; ``x-expires``); a rerun after that
  classifies again the images whose results were in it. Duplicates (a result delivered twice, an image published twice)
  are written once.
* Images still without a result after ``resend_after`` seconds without progress are published again.
* ``--model NAME`` (and ``--model-version V``) sends the jobs to that model's queue, for the workers
  that serve it (``service.jobs.topology``); without it, the default model's.
* Without a broker connection within ``--connect-timeout`` it stops with ``EX_UNAVAILABLE`` (69);
  Ctrl-C or SIGTERM stops it with ``EX_INTERRUPTED`` (130) and one line saying that the same command
  resumes the run (it does: see above), no traceback.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

from service.errors import BackendUnavailable, GatewayError
from service.images.files import MEDIA_TYPE_OF, is_image_file
from service.images.imageinfo import probe
from service.jobs.acks import Acks
from service.jobs.broker import Broker
from service.jobs.messages import new_job_id, request_message
from service.jobs.topology import Names, Route, declare_replicated, ingest_arguments, queue_exists
from service.serving.catalog import VERSION, load_catalog
from service.settings import Settings
from service.settings.values import MODEL_NAME
from service.tracing import Tracing, publishing

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT = 30.0
"""Seconds ``gateway ingest`` waits for its first connection to the broker (``--connect-timeout``)."""
EX_UNAVAILABLE = 69
"""Exit status without a broker connection within the connect timeout (sysexits' EX_UNAVAILABLE)."""
EX_INTERRUPTED = 130
"""Exit status after SIGINT or SIGTERM (128 + SIGINT, the shell's convention)."""
READ_CHUNK = 32
"""Files read per thread hop while publishing."""


def collect(paths: list[Path]) -> list[Path]:
    """Image files named directly, or found under folders (recursively), absolute and sorted."""
    found: set[Path] = set()
    for path in paths:
        if path.is_dir():
            found.update(p.resolve() for p in path.rglob("*") if is_image_file(p))
        elif path.is_file():
            found.add(path.resolve())
        else:
            raise SystemExit(f"gateway ingest: no such file or folder: {path}")
    return sorted(found)


def finished_paths(out: Path) -> set[str]:
    done: set[str] = set()
    if out.exists():
        for line in out.read_text().splitlines():
            try:
                done.add(json.loads(line)["path"])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by an interruption: that image is redone
    return done


def run_id(out: Path) -> str:
    """Names this output file's results queue: the same file always finds the same queue."""
    return hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:16]


def _read_all(paths: list[str]) -> list[bytes]:
    return [Path(p).read_bytes() for p in paths]


def _result(body: bytes) -> dict[str, Any] | None:
    """A result message's fields, or None for a body that is not a result (acked and skipped).
    Plain JSON, not the pydantic model: the line written is the result as it came, plus its path."""
    try:
        result = json.loads(body)
    except ValueError:
        return None
    if not isinstance(result, dict) or not isinstance(result.get("filename"), str) or "status" not in result:
        return None
    return result


def target_route(settings: Settings, names: Names, model: str | None, version: str | None) -> tuple[Route, bool]:
    """The queue of the jobs of ``model`` (None: the default model) at ``version``, and whether the
    models setting or file names it. A model or version it does not name is refused, but for a
    model that may be in Triton's index (the file has a ``[triton]`` table): that one is taken if
    its queue exists (the gateways and workers that found it declared it)."""
    catalog = load_catalog(settings)
    name = model or catalog.default
    if not MODEL_NAME.fullmatch(name):
        raise SystemExit(f"gateway ingest: {name[:64]!r} is not a model name")
    if version is not None and not VERSION.fullmatch(version):
        raise SystemExit(f"gateway ingest: {version[:64]!r} is not a version (1-999999999)")
    spec = catalog.model(name)
    if spec is None and catalog.discovery is None:
        served = ", ".join(m.name for m in catalog.models)
        raise SystemExit(f"gateway ingest: no model {name!r} is served (the models are {served})")
    if version is not None and spec is not None and spec.version(version) is None:
        versions = ", ".join(v.version for v in spec.versions)
        raise SystemExit(f"gateway ingest: model {name!r} has no version {version!r} (it has {versions})")
    return names.route(name, catalog.default), spec is not None


def content_type(data: bytes) -> str:
    try:
        return MEDIA_TYPE_OF[probe(data).format]
    except GatewayError:
        return "application/octet-stream"  # the worker will say what is wrong with it


class Progress:
    def __init__(self, total: int, already: int) -> None:
        self.total, self.already, self.done, self.failed = total, already, 0, 0
        self.started = time.monotonic()
        self.last_print = 0.0
        self.tty = sys.stderr.isatty()

    def update(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_print < (0.2 if self.tty else 5.0):
            return
        self.last_print = now
        finished = self.already + self.done
        rate = self.done / max(now - self.started, 1e-9)
        width = 30
        filled = int(width * finished / max(self.total, 1))
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] {finished}/{self.total} images, "
            f"{self.failed} failed, {rate:.1f} img/s"
        )
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)


async def run_ingest(
    settings: Settings,
    paths: list[Path],
    out: Path,
    *,
    top_k: int = 5,
    max_outstanding: int = 256,
    resend_after: float = 120.0,
    model: str | None = None,
    version: str | None = None,
    connect_timeout: float | None = CONNECT_TIMEOUT,
) -> int:
    """Classify ``paths`` into ``out`` (see the module's docstring); the exit status. Without a
    broker connection within ``connect_timeout`` seconds (None: wait for ever) it ends with
    ``EX_UNAVAILABLE``; SIGINT (Ctrl-C) or SIGTERM ends it with one line saying how to resume,
    and ``EX_INTERRUPTED``."""
    if not settings.broker_url:
        raise SystemExit("gateway ingest: GATEWAY_BROKER_URL is not set")
    names = Names(settings.queue_prefix)
    route, named = target_route(settings, names, model, version)
    files = collect(paths)
    done_before = finished_paths(out)
    remaining = {str(p) for p in files} - done_before
    progress = Progress(len(files), len(files) - len(remaining))
    if not remaining:
        print(f"nothing to do: all {len(files)} images already have results in {out}", file=sys.stderr)
        return 0
    tracing = Tracing.from_settings(settings, role="ingest")
    broker = Broker(
        settings.broker_url,
        names,
        publish_timeout=settings.publish_timeout,
        prefetch=max_outstanding,
        routes=[route] if named else [],
    )
    try:
        return await _unless_interrupted(
            asyncio.create_task(
                _ingest(
                    settings,
                    broker,
                    tracing,
                    progress,
                    remaining,
                    out,
                    route=route,
                    named=named,
                    top_k=top_k,
                    max_outstanding=max_outstanding,
                    resend_after=resend_after,
                    model=model,
                    version=version,
                    connect_timeout=connect_timeout,
                )
            )
        )
    except Interrupted:
        if progress.tty:
            print(file=sys.stderr)
        finished = progress.already + progress.done
        print(
            f"gateway ingest: interrupted with {finished} of {progress.total} images done in {out}; "
            "run the same command again to resume",
            file=sys.stderr,
        )
        return EX_INTERRUPTED
    finally:
        await broker.aclose()
        if tracing is not None:
            await asyncio.to_thread(tracing.shutdown)


class Interrupted(Exception):
    """SIGINT (Ctrl-C) or SIGTERM stopped the run."""


async def _unless_interrupted(body: asyncio.Task[int]) -> int:
    """``body``'s outcome; SIGINT or SIGTERM meanwhile cancels it (its ``finally`` blocks run: the
    results already written are acked) and raises ``Interrupted`` instead of asyncio's
    KeyboardInterrupt and its chained tracebacks."""
    loop = asyncio.get_running_loop()
    caught: list[int] = []

    def interrupt(sig: int) -> None:
        caught.append(sig)
        body.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupt, sig)
    try:
        return await body
    except asyncio.CancelledError:
        if caught and body.cancelled():
            raise Interrupted from None
        raise
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _ingest(
    settings: Settings,
    broker: Broker,
    tracing: Tracing | None,
    progress: Progress,
    remaining: set[str],
    out: Path,
    *,
    route: Route,
    named: bool,
    top_k: int,
    max_outstanding: int,
    resend_after: float,
    model: str | None,
    version: str | None,
    connect_timeout: float | None,
) -> int:
    """The run itself, once its images are known: connect, publish, write results as they come."""
    names = broker.names
    run = run_id(out)
    try:
        await broker.connect(timeout=connect_timeout)
    except TimeoutError:
        print(
            f"gateway ingest: no connection to the message broker within {connect_timeout:g} s (GATEWAY_BROKER_URL; "
            "the warnings above say why; --connect-timeout waits longer); nothing was published",
            file=sys.stderr,
        )
        return EX_UNAVAILABLE
    assert broker.connection is not None
    if not named and not await queue_exists(broker.connection, route.queue):
        raise SystemExit(
            f"gateway ingest: no model {route.model!r} is served: it is not in the models file, and no gateway "
            f"or worker has found it in Triton's index (no queue {route.queue})"
        )
    assert broker.channel is not None
    assert broker.topology is not None
    assert broker.connection is not None
    # replicated: it survives its node's loss in a cluster; it expires once unused for
    # ingest_results_ttl, so a run never rerun does not leave it for ever (a run resumed from an
    # earlier version's queue, declared without the expiry, keeps that queue)
    arguments = ingest_arguments(settings.ingest_results_ttl)
    queue = await declare_replicated(broker.connection, broker.channel, names.ingest_queue(run), arguments)
    await queue.bind(broker.topology.results_exchange, f"ingest.{run}")
    all_done = asyncio.Event()
    last_progress = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as sink:
        acks = Acks(before_ack=sink.flush)  # lines written out before their results are acked
        acks.start()

        async def on_result(message: AbstractIncomingMessage) -> None:
            nonlocal last_progress
            acks.received(message)
            result = _result(message.body)
            if result is not None:
                path, status = result["filename"], result["status"]
                if tracing is not None:
                    tracing.job_result(message.headers, str(result.get("job_id")), str(status))
                if path in remaining:
                    remaining.discard(path)
                    sink.write(json.dumps({"path": path, **result}) + "\n")
                    progress.done += 1
                    progress.failed += status == "failed"
                    last_progress = time.monotonic()
                    progress.update()
            acks.finished(message)  # acked once the line is flushed: a crash before means a redelivery
            if not remaining:
                all_done.set()

        async def publish(path: str, data: bytes) -> None:
            job_id = new_job_id()
            # each image is one trace: this publish, the worker's job, its result back here
            with publishing(tracing, job_id) as trace:
                message = request_message(
                    data,
                    job_id=job_id,
                    content_type=content_type(data),
                    filename=path,
                    top_k=top_k,
                    reply_to=f"ingest.{run}",
                    trace=trace,
                    model=model,
                    version=version,
                )
                delay = 0.2
                while path in remaining:
                    try:
                        await broker.publish("requests", message, route.key)
                        return
                    except BackendUnavailable as exc:  # the broker is away: wait for the reconnect
                        logger.info("ingest: publish failed (%s); retrying", exc.detail)
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, 5.0)

        async def publish_all(paths: list[str]) -> None:
            """Read files a chunk per thread hop (a hop costs more than reading one photo), and
            keep at most ``max_outstanding`` publishes awaiting their confirm."""
            publishing_now: set[asyncio.Task[None]] = set()
            for start in range(0, len(paths), READ_CHUNK):
                chunk = paths[start : start + READ_CHUNK]
                for path, data in zip(chunk, await asyncio.to_thread(_read_all, chunk), strict=True):
                    await window.acquire()
                    task = asyncio.create_task(publish(path, data))
                    publishing_now.add(task)
                    task.add_done_callback(publishing_now.discard)
                    task.add_done_callback(lambda _: window.release())
            await asyncio.gather(*publishing_now)

        consumer_tag = await queue.consume(on_result)
        window = asyncio.Semaphore(max_outstanding)
        try:
            print(f"ingesting {len(remaining)} images ({progress.already} already done) -> {out}", file=sys.stderr)
            await publish_all(sorted(remaining))
            while not all_done.is_set():
                try:
                    async with asyncio.timeout(1.0):
                        await all_done.wait()
                except TimeoutError:
                    progress.update()
                    if time.monotonic() - last_progress > resend_after:
                        logger.warning(
                            "ingest: no result for %.0f s; publishing %d images again", resend_after, len(remaining)
                        )
                        last_progress = time.monotonic()
                        await publish_all(sorted(remaining))
            await queue.cancel(consumer_tag)
        finally:  # interrupted too: the results already written are acked, not delivered again
            await acks.aclose()
    progress.update(force=True)
    if progress.tty:
        print(file=sys.stderr)
    await queue.delete(if_unused=False, if_empty=False)
    print(f"{progress.done} results written ({progress.failed} failed) to {out}", file=sys.stderr)
    return 0
