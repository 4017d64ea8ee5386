"""Logging: text or JSON lines, every line a request or job causes tagged with its ids, and repeated
warnings rate-limited.

* ``REQUEST_ID`` and ``JOB_ID`` are context variables, set by the HTTP edge
  (``service.http.middleware.RequestMiddleware``) and by the queue worker for the task that handles one
  request or job; ``ContextFilter`` copies them, and the current trace and span ids, onto each record.
* ``RateLimitFilter`` lets one line of a given warning (same logger, same message template) through
  per interval and counts the rest, so a failing backend or a flood of bad input cannot drown the
  log (or the disk) in copies of one line.
* ``log_config`` is a ``logging.config.dictConfig`` dictionary, handed to uvicorn too so its own
  loggers write the same format.
"""

from __future__ import annotations

import logging
import logging.config
import threading
import time
from contextvars import ContextVar
from logging import Handler
from typing import IO, Any, Literal

from opentelemetry import trace

REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)
JOB_ID: ContextVar[str | None] = ContextVar("job_id", default=None)

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JSON_FIELDS = "%(levelname)s %(name)s %(message)s"
"""Fields every JSON line has (``timestamp``, ``level``, ``logger``, ``message`` once renamed); the
ids are added when a request, job or trace is current, and ``extra=`` fields are kept."""
CONTEXT_FIELDS = ("request_id", "job_id", "trace_id", "span_id")


class ContextFilter(logging.Filter):
    """Tag a record with the ids of the request, job and span current where it was logged (only
    those that are set, so lines outside a request stay short)."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = REQUEST_ID.get()
        if request_id is not None:
            record.request_id = request_id
        job_id = JOB_ID.get()
        if job_id is not None:
            record.job_id = job_id
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            record.trace_id = format(span.trace_id, "032x")
            record.span_id = format(span.span_id, "016x")
        return True


class RateLimitFilter(logging.Filter):
    """At most one record per ``interval`` seconds for each (logger, message template) at WARNING
    or above; the next one let through says how many were dropped in between."""

    def __init__(self, interval: float) -> None:
        super().__init__()
        self.interval = interval
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}
        """(logger, template) -> (when one was last let through, how many were dropped since)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if self.interval <= 0 or record.levelno < logging.WARNING:
            return True
        key = (record.name, str(record.msg))
        now = time.monotonic()
        with self._lock:
            last, dropped = self._seen.get(key, (-self.interval, 0))
            if now - last < self.interval:
                self._seen[key] = (last, dropped + 1)
                return False
            if len(self._seen) >= 4096:  # templates are few; this bounds a pathological caller
                self._seen.clear()
            self._seen[key] = (now, 0)
        if dropped:
            record.suppressed = dropped
            record.msg = f"{record.msg} ({dropped} like it suppressed in the last {now - last:.1f} s)"
        return True


class TextFormatter(logging.Formatter):
    """The classic one-line format, with the request/job/trace ids appended when there are any."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = [f"{name}={getattr(record, name)}" for name in CONTEXT_FIELDS if hasattr(record, name)]
        return f"{line} [{' '.join(ids)}]" if ids else line


def formatter(fmt: LogFormat) -> logging.Formatter:
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        return JsonFormatter(JSON_FIELDS, rename_fields={"levelname": "level", "name": "logger"}, timestamp=True)
    return TextFormatter(TEXT_FORMAT)


def gateway_handler(fmt: LogFormat = "text", repeat_interval: float = 10.0, stream: IO[str] | None = None) -> Handler:
    """A stream handler (stderr by default) writing ``fmt`` lines, tagged and rate-limited."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter(fmt))
    handler.addFilter(ContextFilter())
    handler.addFilter(RateLimitFilter(repeat_interval))
    return handler


QUIET_LIBRARIES = ("aio_pika", "aiormq")
"""Loggers held at warning by ``log_config`` (their info lines name the broker's address)."""


def log_config(level: str, fmt: LogFormat = "text", repeat_interval: float = 10.0) -> dict[str, Any]:
    """A dictConfig for the gateway's loggers and uvicorn's (``uvicorn.run(log_config=...)``)."""
    level = level.upper()
    # Libraries whose info lines name internal endpoints (aio-pika's reconnects name the broker's
    # URL): at warning, where the operator's details are, unless the gateway logs at debug.
    quiet = level if level == "DEBUG" or logging.getLevelName(level) > logging.WARNING else "WARNING"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "handlers": {"gateway": {"()": "service.logs.gateway_handler", "fmt": fmt, "repeat_interval": repeat_interval}},
        "root": {"handlers": ["gateway"], "level": level},
        "loggers": {
            **{
                name: {"handlers": [], "level": level, "propagate": True}
                for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
            },
            **{name: {"handlers": [], "level": quiet, "propagate": True} for name in QUIET_LIBRARIES},
        },
    }


def configure_logging(level: str, fmt: LogFormat = "text", repeat_interval: float = 10.0) -> dict[str, Any]:
    """Apply ``log_config`` to this process and return it (for uvicorn, which applies it again in
    each worker process it starts)."""
    config = log_config(level, fmt, repeat_interval)
    logging.config.dictConfig(config)
    return config
