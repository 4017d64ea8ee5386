"""Each backend's capabilities are declared once (``service.backends.capabilities``): every value of
``GATEWAY_BACKEND`` and the shared engine has its row, and a version's row is what runs it."""

from __future__ import annotations

import typing

from service.backends.capabilities import CAPABILITIES, capabilities_of
from service.backends.factory import BACKENDS
from service.settings import Settings


def test_every_backend_declares_its_capabilities() -> None:
    """A backend the settings accept, the factory builds and the table lacks would fail at the first
    request that asks what it can do: each has a row, named as ``runs_on`` names it."""
    accepted = set(typing.get_args(Settings.model_fields["backend"].annotation))
    assert accepted == set(BACKENDS)
    assert set(CAPABILITIES) == accepted | {"engine"}
    assert all(name == row.name for name, row in CAPABILITIES.items())


def test_a_version_gets_the_row_of_what_runs_it() -> None:
    """A worker of the shared engine is the engine's (its model elsewhere, torch's precision); Triton
    holds its models outside the budget; the torch backend's memory is not estimated."""
    engine = capabilities_of(Settings(backend="torch", torch_engine="shared", engine_socket="engine.sock"))
    assert (engine.name, engine.model_elsewhere) == ("engine", True)
    assert engine.precision(Settings(backend="torch", torch_device="cpu")) == "fp32"
    assert engine.precision(Settings(backend="torch", torch_device="cuda")) == "fp16"
    per_worker = capabilities_of(Settings(backend="torch", engine_socket="engine.sock"))
    assert (per_worker.name, per_worker.model_elsewhere, per_worker.estimates_memory) == ("torch", False, False)
    triton = capabilities_of(Settings(backend="triton"))
    assert (triton.in_budget, triton.on_triton, triton.precision(Settings())) == (False, True, "as deployed in Triton")
    openvino = Settings(backend="openvino", openvino_precision="int8")
    assert capabilities_of(openvino).precision(openvino) == "int8"


def test_a_free_slot_sends_at_once_where_waiting_only_adds_a_wait() -> None:
    """The in-process CPU runtimes (a free slot is idle cores) and the shared engine (it batches the
    workers' batches again) send what is queued at once; Triton and a per-worker GPU wait to fill
    the next batch while one runs."""
    sends = {name for name, row in CAPABILITIES.items() if row.sends_at_once}
    assert sends == {"embedded", "openvino", "engine"}
    assert capabilities_of(Settings(backend="torch", torch_engine="shared", engine_socket="e.sock")).sends_at_once
    assert not capabilities_of(Settings(backend="torch")).sends_at_once
