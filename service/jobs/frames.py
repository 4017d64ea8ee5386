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
pamqp's decoder tables and its header-frame function, so ``tests/jobs/test_hostile_amqp.py`` checks
both against a real broker: a pamqp release that renames them fails those tests.
"""

from __future__ import annotations

import datetime
import logging
import struct
from collections.abc import Callable

from pamqp import commands, common, decode, frame, header

from service.jobs.messages import UNDECODABLE_HEADER

logger = logging.getLogger(__name__)

_INSTALLED = False


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
            logger.warning("amqp: a message's properties could not be decoded (%s); passed on without them", reason)
            return content

    return unmarshal


def install() -> None:
    """Make pamqp's decoding of incoming properties survive hostile values (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    decode.METHODS["timestamp"] = _timestamp
    decode.TABLE_MAPPING[b"T"] = _timestamp
    frame._unmarshal_header_frame = _tolerant_header_frame(frame._unmarshal_header_frame)  # type: ignore[assignment]
    _INSTALLED = True
