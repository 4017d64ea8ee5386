"""Optional API keys: who gets in, what stays open, and that keys never reach the logs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from service.backends.fake import FakeBackend
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, solid_image

KEY = "k3y-0f-the-test-Zq81"
PNG = png_bytes(solid_image(3, 16))


async def classify(client: httpx.AsyncClient, **headers: str) -> httpx.Response:
    return await client.post("/classify", content=PNG, headers={"content-type": "image/png", **headers})


def unauthorized(response: httpx.Response) -> bool:
    body = response.json()
    return (
        response.status_code == 401
        and body["error"] == "unauthorized"
        and response.headers.get("www-authenticate") == "Bearer"
    )


async def test_keys_guard_everything_but_health(
    gateway_factory: Callable[..., Settings], caplog: pytest.LogCaptureFixture
) -> None:
    settings = gateway_factory(backend="fake", api_keys=f"other-key, {KEY}", log_level="debug")
    async with running_gateway(settings, FakeBackend()) as client:
        missing = await classify(client)
        wrong = await classify(client, authorization="Bearer nope")
        assert unauthorized(missing)
        assert unauthorized(wrong)
        # nothing says whether the key was absent or wrong (only the request ids differ)
        assert {**missing.json(), "request_id": ""} == {**wrong.json(), "request_id": ""}
        for path in ("/metrics", "/docs", "/openapi.json", "/jobs/abc"):
            assert unauthorized(await client.get(path)), path

        bearer = await classify(client, authorization=f"Bearer {KEY}")
        x_api_key = await classify(client, **{"x-api-key": "other-key"})
        assert bearer.status_code == 200
        assert x_api_key.status_code == 200

        assert (await client.get("/healthz")).status_code == 200
        open_readyz = await client.get("/readyz")
        assert open_readyz.status_code == 200
        assert open_readyz.json()["checks"] == {"backend": "ok", "batcher": "ok"}  # no internals without a key
        keyed = await client.get("/readyz", headers={"x-api-key": KEY})
        assert keyed.json()["checks"]["backend"] == "fake: ok"
        metrics = (await client.get("/metrics", headers={"x-api-key": KEY})).text
    assert 'status="401"' in metrics
    assert KEY not in caplog.text
    assert KEY not in repr(settings)


async def test_keys_from_a_file_and_public_metrics(gateway_factory: Callable[..., Settings], tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# mounted from a Kubernetes Secret\n{KEY}\n\n")
    settings = gateway_factory(backend="fake", api_keys_file=keys, metrics_public=True)
    async with running_gateway(settings, FakeBackend()) as client:
        assert (await client.get("/metrics")).status_code == 200
        assert unauthorized(await classify(client))
        ok = await classify(client, authorization=f"bearer {KEY}")
        assert ok.status_code == 200


async def test_no_keys_means_no_authentication(gateway_factory: Callable[..., Settings]) -> None:
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
        assert (await classify(client)).status_code == 200
        assert (await client.get("/readyz")).json()["checks"]["backend"] == "fake: ok"
