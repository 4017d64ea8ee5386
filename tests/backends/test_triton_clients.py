"""Triton over HTTP needs the ``triton`` extra (tritonclient's HTTP client and its gevent); without
it the gateway says which setting needs what to install, not an ImportError from inside tritonclient."""

from __future__ import annotations

import sys

import pytest

from service.backends.triton_clients import client_module


def test_grpc_comes_with_the_gateway() -> None:
    assert client_module("grpc").__name__ == "tritonclient.grpc"
    assert client_module("grpc", aio=True).__name__ == "tritonclient.grpc.aio"


def test_http_without_its_extra_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "tritonclient.http" or m.startswith(("tritonclient.http.", "gevent"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "geventhttpclient", None)  # as if not installed
    with pytest.raises(RuntimeError) as refused:
        client_module("http", aio=True)
    message = str(refused.value)
    assert message.startswith("GATEWAY_TRITON_PROTOCOL=http needs tritonclient's HTTP client, not installed here")
    assert message.endswith("pip install 'inference-gateway[triton]'")
