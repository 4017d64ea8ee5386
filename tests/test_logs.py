"""Log lines: JSON or text, tagged with the request (or job) and trace they belong to, and repeated
warnings rate-limited."""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from loadtests.harness.otlp_receiver import OTLPReceiver
from service.backends.fake import FakeBackend
from service.errors import BackendError
from service.logs import QUIET_LIBRARIES, REQUEST_ID, gateway_handler, log_config
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, solid_image

TRACE = "6bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """The gateway's JSON handler on the root logger, writing into a buffer, for one test."""
    stream = io.StringIO()
    handler = gateway_handler("json", 10.0, stream)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield stream
    finally:
        root.removeHandler(handler)


@contextmanager
def own_logger(name: str, repeat_interval: float) -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger of its own at INFO with the gateway's text handler writing into a buffer."""
    stream = io.StringIO()
    logger = logging.getLogger(name)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = gateway_handler("text", repeat_interval, stream)
    logger.addHandler(handler)
    try:
        yield logger, stream
    finally:
        logger.removeHandler(handler)


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


async def test_a_failed_requests_json_log_line_carries_its_request_and_trace_ids(
    gateway_factory: Callable[..., Settings], json_log: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    backend = FakeBackend()
    with OTLPReceiver() as receiver:
        settings = gateway_factory(backend="fake", tracing_endpoint=receiver.endpoint, tracing_sample_ratio=0.0)
        async with running_gateway(settings, backend) as client:
            backend.fail_next = BackendError("the model crashed")
            r = await client.post(
                "/classify",
                content=png_bytes(solid_image(1, 16)),
                headers={"content-type": "image/png", "traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"},
            )
    assert r.status_code == 500
    request_id = r.headers["x-request-id"]
    assert r.json()["request_id"] == request_id
    failed = [line for line in lines(json_log) if str(line["message"]).startswith("request failed: backend_error")]
    assert len(failed) == 1, json_log.getvalue()
    line = failed[0]
    assert line["level"] == "WARNING"
    assert line["logger"] == "service.http.fastpath"
    assert line["request_id"] == request_id
    assert line["trace_id"] == TRACE
    assert "timestamp" in line


def test_repeated_warnings_are_rate_limited_and_counted() -> None:
    with own_logger("tests.rate_limited", 0.3) as (logger, stream):
        for i in range(5):
            logger.warning("backend down: attempt %d", i)
        logger.warning("another message")  # a different template is its own
        logger.info("info lines are never limited")
        logger.info("info lines are never limited")
        time.sleep(0.35)
        logger.warning("backend down: attempt %d", 99)
    written = stream.getvalue().splitlines()
    assert len(written) == 5, written
    assert written[0].endswith("backend down: attempt 0")
    assert "another message" in written[1]
    assert "backend down: attempt 99 (4 like it suppressed in the last 0." in written[4]


def test_text_lines_name_the_request() -> None:
    with own_logger("tests.text", 10.0) as (logger, stream):
        token = REQUEST_ID.set("abc123")
        try:
            logger.info("inside a request")
        finally:
            REQUEST_ID.reset(token)
        logger.info("outside")
    inside, outside = stream.getvalue().splitlines()
    assert inside.endswith("INFO tests.text: inside a request [request_id=abc123]")
    assert outside.endswith("INFO tests.text: outside")


@pytest.mark.parametrize(("level", "libraries"), [("info", "WARNING"), ("debug", "DEBUG"), ("error", "ERROR")])
def test_libraries_that_name_the_broker_are_held_at_warning(level: str, libraries: str) -> None:
    """aio-pika's and aiormq's info lines name the broker's URL (host, port, user): at the
    gateway's info level they are held at warning, where the operator's details are (issue 46: no
    info line names an internal endpoint); at debug everything shows, and a stricter level holds."""
    loggers = log_config(level)["loggers"]
    assert {name: loggers[name]["level"] for name in QUIET_LIBRARIES} == dict.fromkeys(QUIET_LIBRARIES, libraries)
    assert set(QUIET_LIBRARIES) == {"aio_pika", "aiormq"}
