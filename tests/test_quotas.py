"""Per-key quotas: a key over its rate or concurrency gets 429 with Retry-After while other keys
are served, metrics name keys by hash only, and the table is shared by every process that opens it."""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from service.backends.fake import FakeBackend
from service.errors import PayloadTooLarge, QuotaExceeded
from service.quotas import ApiKey, Quota, Quotas, parse_keys
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, solid_image

PNG = png_bytes(solid_image(3, 16))
LIMITED, FREE, SERIAL = "limited-key-7Hq2", "free-key-0pX9", "serial-key-Wm4c"


def key_id(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()[:12]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr("service.quotas.time.monotonic", clock)
    return clock


def test_entries_take_their_own_limits_and_the_defaults_for_the_rest() -> None:
    keys = parse_keys(["a rate=5 concurrency=2", "  # a comment", "", "b", "c burst=3"], Quota(rate=1.0, concurrency=8))
    assert [k.secret for k in keys] == [b"a", b"b", b"c"]
    assert keys[0].quota == Quota(rate=5.0, burst=0.0, concurrency=2)
    assert keys[1].quota == Quota(rate=1.0, burst=0.0, concurrency=8)
    assert keys[2].quota == Quota(rate=1.0, burst=3.0, concurrency=8)
    assert keys[0].id == key_id("a")
    with pytest.raises(ValueError, match="rate=, burst= or concurrency=") as bad:
        parse_keys(["s3cret speed=4"], Quota())
    assert "s3cret" not in str(bad.value)  # errors name the key by its id
    with pytest.raises(ValueError, match="not a number"):
        parse_keys(["k rate=fast"], Quota())


def test_the_bucket_refills_at_the_rate_and_says_when_to_retry(clock: Clock) -> None:
    quotas = Quotas([ApiKey(b"k", Quota(rate=2.0, burst=4.0))], max_images=4)
    kid = key_id("k")
    quotas.take(kid, 4)  # a full bucket after idling
    with pytest.raises(QuotaExceeded) as refused:
        quotas.take(kid, 3)
    assert refused.value.status_code == 429
    assert refused.value.headers["Retry-After"] == "2"  # 3 images at 2/s: 1.5 s, rounded up
    clock.now += 1.0  # 2 tokens back
    quotas.take(kid, 2)
    with pytest.raises(QuotaExceeded):
        quotas.take(kid, 1)
    clock.now += 100.0  # never more than the burst
    quotas.take(kid, 4)
    with pytest.raises(QuotaExceeded):
        quotas.take(kid, 1)
    with pytest.raises(PayloadTooLarge, match="at most 4 at once"):  # could never pass: not a 429
        quotas.take(kid, 5)


def test_the_default_burst_lets_a_full_request_through() -> None:
    quotas = Quotas([ApiKey(b"k", Quota(rate=1.0))], max_images=16)
    quotas.take(key_id("k"), 16)


def test_concurrency_counts_requests_in_progress() -> None:
    quotas = Quotas([ApiKey(b"k", Quota(concurrency=2)), ApiKey(b"other")], max_images=1)
    quotas.enter(key_id("k"))
    quotas.enter(key_id("k"))
    with pytest.raises(QuotaExceeded, match="2 request"):
        quotas.enter(key_id("k"))
    quotas.enter(key_id("other"))  # no quota: never counted
    quotas.leave(key_id("k"))
    quotas.enter(key_id("k"))


def test_processes_opening_the_same_folder_share_the_buckets(tmp_path: Path, clock: Clock) -> None:
    keys = [ApiKey(b"a", Quota(rate=1.0, burst=3.0)), ApiKey(b"b", Quota(rate=1.0, burst=3.0))]
    first, second = Quotas(keys, 1, tmp_path), Quotas(keys, 1, tmp_path)  # as two workers would
    first.take(key_id("a"), 2)
    second.take(key_id("a"), 1)
    with pytest.raises(QuotaExceeded):
        first.take(key_id("a"), 1)
    second.take(key_id("b"), 3)  # each key its own bucket
    private = Quotas(keys, 1)
    private.take(key_id("a"), 3)  # without the folder, a table of its own


async def test_a_key_over_its_quota_gets_429_while_other_keys_are_served(
    gateway_factory: Callable[..., Settings], caplog: pytest.LogCaptureFixture
) -> None:
    settings = gateway_factory(
        backend="fake", api_keys=f"{LIMITED} rate=0.01 burst=2,{FREE},{SERIAL} concurrency=1", log_level="debug"
    )
    async with running_gateway(settings, FakeBackend(delay=0.3)) as client:

        async def classify(key: str, images: int = 1) -> httpx.Response:
            files = [("file", (f"{i}.png", PNG, "image/png")) for i in range(images)]
            return await client.post("/classify", files=files, headers={"x-api-key": key})

        assert (await classify(LIMITED, 2)).status_code == 200
        over = await classify(LIMITED)
        assert over.status_code == 429
        assert over.json()["error"] == "quota_exceeded"
        assert "0.01 images/s" in over.json()["detail"]
        assert int(over.headers["retry-after"]) >= 60
        assert (await classify(FREE, 3)).status_code == 200  # another key is served meanwhile

        together = await asyncio.gather(classify(SERIAL), classify(SERIAL), classify(FREE))
        assert sorted(r.status_code for r in together[:2]) == [200, 429]
        refused = next(r for r in together[:2] if r.status_code == 429)
        assert "in progress" in refused.json()["detail"]
        assert together[2].status_code == 200
        assert (await classify(SERIAL)).status_code == 200  # the slot is free again

        metrics = (await client.get("/metrics", headers={"x-api-key": FREE})).text
        openapi = (await client.get("/openapi.json", headers={"x-api-key": FREE})).json()
    too_many = openapi["paths"]["/classify"]["post"]["responses"]["429"]
    assert "quota_exceeded" in too_many["description"]
    assert "Retry-After" in too_many["headers"]
    assert re.search(rf'gateway_quota_rejections_total{{key="{key_id(LIMITED)}",limit="rate"}} 1\.0', metrics)
    assert re.search(rf'gateway_quota_rejections_total{{key="{key_id(SERIAL)}",limit="concurrency"}} 1\.0', metrics)
    assert re.search(rf'gateway_key_images_total{{key="{key_id(FREE)}"}} 4\.0', metrics)
    assert 'gateway_rejections_total{reason="quota_exceeded"} 2.0' in metrics
    for secret in (LIMITED, FREE, SERIAL):
        assert secret not in metrics
        assert secret not in caplog.text
