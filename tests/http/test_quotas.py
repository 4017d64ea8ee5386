"""Per-key quotas: a key over its rate or concurrency gets 429 with Retry-After while other keys
are served, metrics name keys by hash only, and the table is shared by every process that opens it."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from service.backends.fake import FakeBackend
from service.errors import PayloadTooLarge, QuotaExceeded
from service.http.quotas import Quotas
from service.settings import Settings
from service.settings.keys import MAX_CONCURRENCY, ApiKey, Quota, parse_keys
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
    monkeypatch.setattr("service.http.quotas.time.monotonic", clock)
    return clock


def test_entries_take_their_own_limits_and_the_defaults_for_the_rest() -> None:
    keys = parse_keys(["a rate=5 concurrency=2", "  # a comment", "", "b", "c burst=3"], Quota(rate=1.0, concurrency=8))
    assert [k.secret for k in keys] == [b"a", b"b", b"c"]
    assert keys[0].quota == Quota(rate=5.0, burst=0.0, concurrency=2)
    assert keys[1].quota == Quota(rate=1.0, burst=0.0, concurrency=8)
    assert keys[2].quota == Quota(rate=1.0, burst=3.0, concurrency=8)
    assert keys[0].id == key_id("a")
    with pytest.raises(ValueError, match="rate=, burst=, concurrency=, models= or rate@MODEL=") as bad:
        parse_keys(["s3cret speed=4"], Quota())
    assert "s3cret" not in str(bad.value)  # errors name the key by its id
    with pytest.raises(ValueError, match="not a number"):
        parse_keys(["k rate=fast"], Quota())


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("k rate=nan", "is negative, or not finite"),
        ("k rate=inf", "is negative, or not finite"),
        ("k models=", "models=NAME|NAME"),
        ("k models=Shop", "models=NAME|NAME"),
        ("k rate@shop=0", "must be a rate above 0"),
        ("k rate@shop=nan", "must be a rate above 0"),
        ("k rate@Shop=1", "expected rate="),
    ],
)
def test_wrong_model_limits_are_refused(entry: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_keys([entry], Quota())


def test_a_rate_on_one_model_is_spent_with_the_keys_own_and_refunded_when_that_refuses(clock: Clock) -> None:
    (key,) = parse_keys(["k rate=4 burst=4 models=shop|moderation rate@shop=1 burst=4"], Quota())
    assert key.quota.models == frozenset({"shop", "moderation"})
    assert key.quota.model_rates == (("shop", 1.0),)
    quotas = Quotas([key], max_images=2)
    kid = key_id("k")
    quotas.take(kid, 2, "shop")  # shop's bucket: its burst is max(rate, max_images) = 2
    with pytest.raises(QuotaExceeded, match="over its rate on model 'shop' of 1 images/s"):
        quotas.take(kid, 1, "shop")
    quotas.take(kid, 2, "moderation")  # the key's own bucket has 4 - 2 - 2 = 0 left now
    clock.now += 2.0  # shop: 2 back; the key: 8 back, to its burst of 4
    quotas.take(kid, 2, "moderation")
    quotas.take(kid, 2, "moderation")  # the key's bucket empty again
    with pytest.raises(QuotaExceeded, match="over its rate of 4"):
        quotas.take(kid, 2, "shop")  # refused by the key's bucket: shop's tokens are given back
    clock.now += 0.5  # the key: 2 back
    quotas.take(kid, 2, "shop")  # shop still had its 2


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


def test_a_concurrency_over_the_most_is_refused_with_its_key_named() -> None:
    """A limit over MAX_CONCURRENCY (each is a slot a refusal asks about) is a configuration error
    naming the key by its id, whether on the entry or the default; the most itself is accepted."""
    assert parse_keys([f"k concurrency={MAX_CONCURRENCY}"], Quota())[0].quota.concurrency == MAX_CONCURRENCY
    for entries, default in (
        ([f"s3cret concurrency={MAX_CONCURRENCY + 1}"], Quota()),
        (["s3cret"], Quota(concurrency=10**9)),
    ):
        with pytest.raises(ValueError, match=f"concurrency .* over {MAX_CONCURRENCY}.*0 means unlimited") as bad:
            parse_keys(entries, default)
        assert key_id("s3cret") in str(bad.value)
        assert "s3cret" not in str(bad.value).replace(key_id("s3cret"), "")
    with pytest.raises(ValueError, match="negative"):
        parse_keys(["k concurrency=-1"], Quota())


def test_instances_on_one_folder_share_the_slots(tmp_path: Path) -> None:
    """Two instances on one folder (as two workers) count one key's requests together, each key
    on its own; a slot freed by one is taken by the other, and closing an instance frees its slots."""
    keys = [ApiKey(b"k", Quota(concurrency=2)), ApiKey(b"j", Quota(concurrency=1)), ApiKey(b"free")]
    first, second = Quotas(keys, 1, tmp_path), Quotas(keys, 1, tmp_path)
    first.enter(key_id("k"))
    second.enter(key_id("k"))
    for quotas in (first, second):
        with pytest.raises(QuotaExceeded, match="2 request"):
            quotas.enter(key_id("k"))
    second.enter(key_id("j"))  # another key: its own slots
    second.enter(key_id("free"))  # no limit: nothing held
    first.leave(key_id("k"))
    second.enter(key_id("k"))
    with pytest.raises(QuotaExceeded):
        first.enter(key_id("k"))
    second.close()
    first.enter(key_id("k"))
    first.enter(key_id("k"))
    first.enter(key_id("j"))


HOLDER = r"""
import os, signal, sys
from pathlib import Path
from service.http.quotas import Quotas
from service.settings.keys import ApiKey, Quota

key = ApiKey(b"serial", Quota(concurrency=1))
quotas = Quotas([key], 1, Path(sys.argv[1]))
quotas.enter(key.id)
if sys.argv[2] == "fork" and os.fork() == 0:
    os.write(1, f"forked {os.getpid()}\n".encode())  # one write each: the two lines do not mix
    signal.pause()
os.write(1, f"holding {os.getpid()}\n".encode())
signal.pause()
"""


@pytest.fixture
def holders() -> Iterator[Callable[[Path, bool], dict[str, int]]]:
    """Start processes that hold the one slot of key ``serial`` in a folder (and fork a child that
    lives on, with ``fork``): the pids they report, once they hold it; each is SIGKILLed after."""
    started: list[subprocess.Popen[str]] = []
    forked: list[int] = []

    def start(folder: Path, fork: bool) -> dict[str, int]:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(folder), "fork" if fork else "no"], stdout=subprocess.PIPE, text=True
        )
        started.append(proc)
        assert proc.stdout is not None
        reported = {what: int(pid) for what, pid in (proc.stdout.readline().split() for _ in range(1 + fork))}
        forked.extend(pid for what, pid in reported.items() if what == "forked")
        assert reported.get("holding") == proc.pid, reported
        return reported

    yield start
    for pid in forked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for proc in started:
        proc.kill()
        proc.wait()


def test_a_sigkilled_process_holds_no_slot(tmp_path: Path, holders: Callable[[Path, bool], dict[str, int]]) -> None:
    """A process SIGKILLed while its request holds a key's only slot (an OOM-killed or hung
    worker) stops counting as soon as it is dead: the kernel drops its lock, nobody clears a table."""
    quotas = Quotas([ApiKey(b"serial", Quota(concurrency=1))], 1, tmp_path)
    holder = holders(tmp_path, False)["holding"]
    with pytest.raises(QuotaExceeded):
        quotas.enter(key_id("serial"))
    os.kill(holder, signal.SIGKILL)
    os.waitpid(holder, 0)
    quotas.enter(key_id("serial"))


def test_a_child_forked_by_a_holder_does_not_keep_its_slots(
    tmp_path: Path, holders: Callable[[Path, bool], dict[str, int]]
) -> None:
    """A process forked by one holding a slot (it shares the parent's open files) does not keep the
    slot held once the parent is SIGKILLed: the child drops its copies of the lock files at fork."""
    quotas = Quotas([ApiKey(b"serial", Quota(concurrency=1))], 1, tmp_path)
    pids = holders(tmp_path, True)
    with pytest.raises(QuotaExceeded):
        quotas.enter(key_id("serial"))
    os.kill(pids["holding"], signal.SIGKILL)
    os.waitpid(pids["holding"], 0)
    os.kill(pids["forked"], 0)  # the child lives on
    quotas.enter(key_id("serial"))


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
