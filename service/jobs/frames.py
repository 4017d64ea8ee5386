"""Incoming AMQP frames whose properties the client library cannot decode: not a connection loss.

pamqp decodes a message's properties inside the connection's frame reader, and an exception there
closes the whole connection (aiormq issue 186). Two kinds of property reach it from any producer, and
RabbitMQ passes both on unchanged:

* a ``timestamp`` (the AMQP property, or a header of type ``T``) beyond what ``datetime`` holds (a
  millisecond or microsecond epoch, a sentinel near 2**64): ``fromtimestamp`` raises ValueError;
* a header table nested a few thousand deep (21 KB for 3,000 levels): the recursive decoder raises
  RecursionError.

The message is not acknowledged, so the broker delivers it again to the next connection: one bad
message was a crash loop for every consumer, and each loss also counted a delivery against every
other message the consumer held (a quorum queue's delivery limit then dead-letters them too).

:func:`install` makes both decodable once per process: a timestamp out of range decodes as the
largest (or smallest) ``datetime``, and a content header that still cannot be decoded decodes with
its sizes and no properties but ``x-gateway-undecodable`` (the reason), which the worker turns into a
``bad_request`` failure and dead-letter copy (``service.jobs.worker``). It replaces entries of
pamqp's decoder tables and its private header-frame function (pamqp 4.0; ``pyproject.toml`` pins
that range), then decodes two hostile header frames through pamqp's own ``frame.unmarshal`` and
raises if either still fails: a pamqp that no longer takes the patch stops the process at start
instead of leaving it with the crash loop. Messages pamqp could decode before decode the same
(``tests/jobs/test_frames.py``); ``tests/jobs/test_hostile_amqp.py`` checks it against a real broker.
"""

from __future__ import annotations

import datetime
import logging
import struct
import threading
from collections.abc import Callable

from pamqp import commands, common, decode, frame, header

from service.jobs.messages import UNDECODABLE_HEADER

logger = logging.getLogger(__name__)

_INSTALLED = False
_LOCK = threading.Lock()
_checking = False
"""Set while :func:`_check` decodes its own hostile frames (nothing to warn about)."""
ORIGINAL_TIMESTAMP = decode.timestamp
ORIGINAL_HEADER_FRAME: Callable[[bytes], header.ContentHeader] | None = getattr(frame, "_unmarshal_header_frame", None)
"""pamqp's own decoders, as they were before :func:`install` (to compare with, in tests)."""


def _timestamp(value: bytes) -> tuple[int, datetime.datetime]:
    """pamqp's decoder (seconds, or milliseconds above 2**32), clamped to what ``datetime`` holds."""
    try:
        (seconds,) = common.Struct.timestamp.unpack(value[0:8])
    except struct.error as err:
        raise ValueError("Could not unpack timestamp value") from err
    if seconds > 0xFFFFFFFF:
        seconds /= 1000.0
    try:
        return 8, datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    except (OverflowError, OSError, ValueError):
        return 8, datetime.datetime.max.replace(tzinfo=datetime.UTC)


def _tolerant_header_frame(
    decoder: Callable[[bytes], header.ContentHeader],
) -> Callable[[bytes], header.ContentHeader]:
    def unmarshal(frame_data: bytes) -> header.ContentHeader:
        try:
            return decoder(frame_data)
        except Exception as exc:  # anything raised here would close the connection
            reason = exc.__cause__ if exc.__cause__ is not None else exc
            content = header.ContentHeader()
            content.class_id, content.weight, content.body_size = struct.unpack(">HHQ", frame_data[0:12])
            content.properties = commands.Basic.Properties(
                headers={UNDECODABLE_HEADER: f"{type(reason).__name__}: {reason}"[:200]}
            )
            if not _checking:
                logger.warning("amqp: a message's properties could not be decoded (%s); passed on without them", reason)
            return content

    return unmarshal


def install() -> None:
    """Make pamqp's decoding of incoming properties survive hostile values (once per process;
    thread-safe). Raises RuntimeError when the pamqp in use does not take the patch."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        original = ORIGINAL_HEADER_FRAME
        if original is None or decode.METHODS.get("timestamp") is not decode.timestamp:
            raise RuntimeError(f"service.jobs.frames: pamqp {_version()} is not the pamqp 4.0 it patches")
        decode.METHODS["timestamp"] = _timestamp
        decode.TABLE_MAPPING[b"T"] = _timestamp
        frame._unmarshal_header_frame = _tolerant_header_frame(original)  # type: ignore[assignment]
        _check()
        _INSTALLED = True


def _version() -> str:
    from importlib.metadata import version

    return version("pamqp")


def _check() -> None:
    """Decode, through pamqp's frame reader, a timestamp past ``datetime`` and a header of a type
    that does not exist: both must come out as :func:`install` says, or the patch did not take."""
    global _checking
    stamp = struct.pack(">HHQH", 60, 0, 0, 1 << 6) + struct.pack(">Q", 2**64 - 1)  # flags: timestamp
    table = b"\x01aZ"  # type Z: none
    bad = struct.pack(">HHQH", 60, 0, 0, 1 << 13) + struct.pack(">I", len(table)) + table  # flags: headers
    decoded = []
    _checking = True
    try:
        for payload in (stamp, bad):
            data = struct.pack(">BHI", 2, 1, len(payload)) + payload + b"\xce"
            decoded.append(frame.unmarshal(data)[2])
    except Exception as exc:
        raise RuntimeError(f"service.jobs.frames: the patch did not take on pamqp {_version()}: {exc}") from exc
    finally:
        _checking = False
    stamped, headed = (
        (content.properties if isinstance(content, header.ContentHeader) else None) for content in decoded
    )
    timestamp = stamped.timestamp if stamped is not None else None
    headers = (headed.headers if headed is not None else None) or {}
    if timestamp != datetime.datetime.max.replace(tzinfo=datetime.UTC) or UNDECODABLE_HEADER not in headers:
        raise RuntimeError(f"service.jobs.frames: the patch did not take on pamqp {_version()}")
