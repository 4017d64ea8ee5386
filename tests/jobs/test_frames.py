"""``service.jobs.frames``: pamqp's decoding of incoming properties, patched so hostile values do
not close the connection, decodes every valid property table exactly as pamqp does unpatched; and a
pamqp the patch does not fit stops the process at start instead of running unpatched."""

from __future__ import annotations

import datetime
import decimal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands, decode, frame, header

from service.jobs import frames

frames.install()

names = st.text(min_size=1, max_size=20)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True, width=32),  # what pamqp encodes a float as
    st.text(max_size=50),
    st.binary(max_size=50).map(bytearray),  # what pamqp encodes as a byte array
    st.decimals(min_value=-1000, max_value=1000, places=2, allow_nan=False, allow_infinity=False),
    st.datetimes(
        min_value=datetime.datetime(1970, 1, 1),
        max_value=datetime.datetime(2106, 2, 7),
        timezones=st.just(datetime.UTC),
    ).map(lambda d: d.replace(microsecond=0)),
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(names, inner, max_size=4), max_leaves=20
)
properties = st.fixed_dictionaries(
    {},
    optional={
        "content_type": st.text(max_size=30),
        "message_id": st.text(max_size=30),
        "reply_to": st.text(max_size=30),
        "priority": st.integers(0, 9),
        "delivery_mode": st.sampled_from([1, 2]),
        "timestamp": st.datetimes(
            min_value=datetime.datetime(1970, 1, 1),
            max_value=datetime.datetime(2106, 2, 7),
            timezones=st.just(datetime.UTC),
        ).map(lambda d: d.replace(microsecond=0)),
        "headers": st.dictionaries(names, values, max_size=6),
    },
)


@contextmanager
def unpatched() -> Iterator[None]:
    """pamqp's decoders as they were before ``frames.install`` (one thread: this test's)."""
    saved = decode.METHODS["timestamp"], decode.TABLE_MAPPING[b"T"], frame._unmarshal_header_frame
    decode.METHODS["timestamp"] = decode.TABLE_MAPPING[b"T"] = frames.ORIGINAL_TIMESTAMP  # type: ignore[assignment]
    frame._unmarshal_header_frame = frames.ORIGINAL_HEADER_FRAME  # type: ignore[assignment]
    try:
        yield
    finally:
        decode.METHODS["timestamp"], decode.TABLE_MAPPING[b"T"] = saved[0], saved[1]
        frame._unmarshal_header_frame = saved[2]  # type: ignore[assignment]


def _plain(value: Any) -> Any:
    """``value`` comparable with ``==`` (NaN and signed zeros by their text; decimals exactly)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, float | decimal.Decimal):
        return (type(value).__name__, repr(value))
    return value


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(properties)
def test_valid_properties_decode_as_without_the_patch(given_properties: dict[str, Any]) -> None:
    """Any property table pamqp encodes (every header type, nested tables and arrays, timestamps
    in range) decodes through the patched reader exactly as through pamqp's own."""
    content = header.ContentHeader(0, 10, commands.Basic.Properties(**given_properties))
    data = frame.marshal(content, 1)
    patched = frame.unmarshal(data)[2]
    with unpatched():
        plain = frame.unmarshal(data)[2]
    assert isinstance(patched, header.ContentHeader)
    assert isinstance(plain, header.ContentHeader)
    assert (patched.body_size, patched.weight, patched.class_id) == (plain.body_size, plain.weight, plain.class_id)
    assert _plain(dict(patched.properties)) == _plain(dict(plain.properties))


def test_a_pamqp_the_patch_does_not_fit_stops_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where pamqp's private header-frame decoder is not what the patch replaces (renamed in
    another release), ``install`` raises instead of leaving the process unpatched, every
    hostile message a connection loss. Before, it replaced nothing and said nothing."""
    monkeypatch.setattr(frames, "_INSTALLED", False)
    monkeypatch.setattr(frames, "ORIGINAL_HEADER_FRAME", None)
    monkeypatch.setattr(frame, "_unmarshal_header_frame", frame._unmarshal_header_frame)
    monkeypatch.setitem(decode.METHODS, "timestamp", decode.METHODS["timestamp"])
    monkeypatch.setitem(decode.TABLE_MAPPING, b"T", decode.TABLE_MAPPING[b"T"])
    with pytest.raises(RuntimeError, match="pamqp"):
        frames.install()
