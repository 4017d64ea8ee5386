"""Users' own models on a real Triton (the tests' tritonserver, Python backend), two ways:

* a declared model file written into Triton's repository by ``gateway models triton-repo``
  (EfficientNet-Lite2 as a user exports it, float32 NCHW, its normalisation left to the gateway):
  Triton serves the derived graph, the gateway serves it with ``backend = "triton"`` and the same
  declaration, and answers real photos right;
* a model already in the user's Triton in its own dtype and layout, declared without ``path``:
  what Triton says completes the declaration (its labels through Triton's classification
  extension), the gateway does the arithmetic in NumPy, and answers as the file does; every
  disagreement, and a Triton that is not there, is a start-up error naming model, version and key.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import textwrap
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from service.backends.triton import TritonBackend
from service.backends.triton_declared import complete_on_triton
from service.cli import main
from service.errors import BackendUnavailable
from service.models.declaration import DeclarationError, parse_declaration
from service.models.profiles import imagenet_labels
from service.serving.catalog import CatalogError, parse_catalog
from service.settings import Settings
from service.triton.server import LocalTriton, Ports, TritonInstall
from tests.conftest import CAT_CLASSES, ESPRESSO, running_gateway
from tests.models.exports import PLAIN, export
from tests.triton_server import free_ports, start_triton

pytestmark = pytest.mark.triton

JPEG = {"content-type": "image/jpeg"}
WHERE = "models.toml: model 'm' version '1'"
TINY_LABELS = ["red", "green", "blue", "none"]


def _toml(keys: dict[str, Any]) -> str:
    """A model's table (strings, numbers and lists of them: JSON's syntax is TOML's)."""
    return "".join(f"{key} = {json.dumps(value)}\n" for key, value in keys.items())


def _python_model(
    repository: Path,
    name: str,
    inputs: list[tuple[str, str, list[int]]],
    outputs: list[tuple[str, str, list[int]]],
    execute: str,
    *,
    max_batch: int = 16,
    labels: list[str] | None = None,
    initialize: str = "pass",
) -> Path:
    """A Python-backend model of the user's: its own tensor names, types and shapes."""
    folder = repository / name
    (folder / "1").mkdir(parents=True)

    def tensors(entries: list[tuple[str, str, list[int]]], labelled: bool) -> str:
        label = ' label_filename: "labels.txt"' if labelled else ""
        return ", ".join(f'{{ name: "{n}" data_type: {t} dims: {d}{label} }}' for n, t, d in entries)

    (folder / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch}\n'
        f"input [ {tensors(inputs, False)} ]\noutput [ {tensors(outputs, labels is not None)} ]\n"
        "dynamic_batching { max_queue_delay_microseconds: 0 }\ninstance_group [ { count: 1 kind: KIND_CPU } ]\n"
    )
    if labels is not None:
        (folder / "labels.txt").write_text("".join(f"{label}\n" for label in labels))
    (folder / "1" / "model.py").write_text(
        "import os\nimport numpy as np\nimport triton_python_backend_utils as pb_utils\n\n"
        "class TritonPythonModel:\n"
        f"    def initialize(self, args):\n{textwrap.indent(initialize, ' ' * 8)}\n\n"
        "    def execute(self, requests):\n        out = []\n        for r in requests:\n"
        f"{textwrap.indent(execute, ' ' * 12)}\n        return out\n"
    )
    return folder


TINY = """x = pb_utils.get_input_tensor_by_name(r, "pixels").as_numpy()
means = x.reshape(x.shape[0], 3, -1).astype(np.float64).mean(2)
y = np.concatenate([means, np.zeros((x.shape[0], 1))], 1).astype(np.float32)
out.append(pb_utils.InferenceResponse([pb_utils.Tensor("logits", y)]))"""
"""The tiny model: float32 NCHW 8x6 in, logits out: each channel's mean as it received it, and 0."""

TINY_UINT8 = """x = pb_utils.get_input_tensor_by_name(r, "rgb").as_numpy()
means = x.reshape(x.shape[0], -1, 3).astype(np.float64).mean(1)
y = np.concatenate([means, np.zeros((x.shape[0], 1))], 1).astype(np.float32)
out.append(pb_utils.InferenceResponse([pb_utils.Tensor("logits", y)]))"""
"""The tiny model of uint8 RGB NHWC, the gateway's own pixels under other names: each channel's mean, and 0."""

ONNX_INIT = """import onnxruntime as ort
options = ort.SessionOptions()
options.intra_op_num_threads = 1
path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])"""
ONNX_RUN = """x = pb_utils.get_input_tensor_by_name(r, "input").as_numpy()
(y,) = self.session.run(["output"], {"input": x})
out.append(pb_utils.InferenceResponse([pb_utils.Tensor("output", y)]))"""
"""The user's own ONNX file as it is (float32 NCHW, normalised input) under its own names."""


def _tiny_models(repository: Path) -> None:
    pixels = [("pixels", "TYPE_FP32", [3, 8, 6])]
    logits = [("logits", "TYPE_FP32", [4])]
    _python_model(repository, "tiny", pixels, logits, TINY, labels=TINY_LABELS)
    _python_model(repository, "two-inputs", [*pixels, ("mask", "TYPE_FP32", [3, 8, 6])], logits, "pass")
    _python_model(repository, "any-channels", [("pixels", "TYPE_FP32", [-1, 8, 6])], logits, "pass")
    _python_model(repository, "short-labels", pixels, logits, TINY, labels=TINY_LABELS[:3])
    _python_model(repository, "tiny-uint8", [("rgb", "TYPE_UINT8", [8, 6, 3])], logits, TINY_UINT8)


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's files: EfficientNet-Lite2 exported as users do, and its ImageNet labels."""
    folder = tmp_path_factory.mktemp("user")
    export(PLAIN, folder / "lite2.onnx")
    (folder / "imagenet.txt").write_text("".join(f"{label}\n" for label in imagenet_labels()))
    return folder


def _declared_file(folder: Path, url: str) -> str:
    """Lite2 declared by its file, on the triton backend (a models file's model)."""
    keys = {"path": str(folder / "lite2.onnx"), "labels": str(folder / "imagenet.txt"), **PLAIN.declaration()}
    return "[models.cars]\n" + _toml({**keys, "backend": "triton", "triton_url": url})


@pytest.fixture(scope="module")
def declared_triton(
    triton_install: TritonInstall, user_folder: Path, models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalTriton]:
    """One Triton holding Lite2 written by ``gateway models triton-repo`` (``cars``), the same
    file served as it is under its own names (``lite2-nchw``, labels in its config), and the tiny
    models of the hostile cases."""
    repository = tmp_path_factory.mktemp("declared-repo")
    (user_folder / "write.toml").write_text(_declared_file(user_folder, "127.0.0.1:1"))
    folders = [
        "--models-file",
        str(user_folder / "write.toml"),
        "--models-dir",
        str(models_dir),
        "--out",
        str(repository),
    ]
    written = main(["models", "triton-repo", *folders, "--variant", "python", "--triton-intra-op-threads", "1"])
    assert written == 0
    lite2 = _python_model(
        repository,
        "lite2-nchw",
        [("input", "TYPE_FP32", [3, 260, 260])],
        [("output", "TYPE_FP32", [1000])],
        ONNX_RUN,
        labels=list(imagenet_labels()),
        initialize=ONNX_INIT,
    )
    shutil.copyfile(user_folder / "lite2.onnx", lite2 / "1" / "model.onnx")
    _tiny_models(repository)
    server = start_triton(triton_install, repository, tmp_path_factory.mktemp("declared-logs"))
    yield server
    server.stop()


def _catalog(text: str, folder: Path, **settings: Any) -> Any:
    return parse_catalog(tomllib.loads(text), Settings(**settings), "models.toml", base=folder)


def _top(answer: Any) -> tuple[int, str, float]:
    best = answer.json()["results"][0]["labels"][0]
    return best["index"], best["label"], best["score"]


async def test_a_declared_file_written_by_triton_repo_is_served_on_triton(
    gateway_factory: Callable[..., Settings],
    declared_triton: LocalTriton,
    user_folder: Path,
    tmp_path: Path,
    cat_jpeg: bytes,
    coffee_jpeg: bytes,
) -> None:
    """Triton serves the derived graph (uint8 NHWC ``images`` in, ``scores`` out, the labels
    beside it: Triton's own classification answers espresso), and the gateway serves it with
    ``backend = "triton"`` and the file's declaration: the right answer for real photos."""
    config = text_format.Parse((declared_triton.repository / "cars" / "config.pbtxt").read_text(), mc.ModelConfig())
    assert (config.input[0].name, list(config.input[0].dims)) == ("images", [260, 260, 3])
    assert (list(config.output[0].dims), config.output[0].label_filename) == ([1000], "labels.txt")
    models = tmp_path / "models.toml"
    models.write_text(_declared_file(user_folder, declared_triton.grpc_url))
    async with running_gateway(gateway_factory(models_file=models)) as client:
        cat = await client.post("/v1/models/cars/classify", content=cat_jpeg, headers=JPEG)
        coffee = await client.post("/v1/models/cars/classify", content=coffee_jpeg, headers=JPEG)
    assert cat.status_code == 200, cat.text
    assert _top(cat)[0] in CAT_CLASSES
    assert _top(coffee)[:2] == (ESPRESSO, "espresso")
    client_ = triton_grpc.InferenceServerClient(declared_triton.grpc_url)
    try:
        images = triton_grpc.InferInput("images", [1, 260, 260, 3], "UINT8")
        images.set_data_from_numpy(np.zeros((1, 260, 260, 3), np.uint8))
        answer = client_.infer("cars", [images], outputs=[triton_grpc.InferRequestedOutput("scores", class_count=3)])
    finally:
        client_.close()
    index, label = answer.as_numpy("scores")[0][0].decode().split(":", 2)[1:]
    assert imagenet_labels()[int(index)] == label


async def test_a_model_in_triton_in_its_own_layout_answers_as_its_file_does(
    gateway_factory: Callable[..., Settings],
    declared_triton: LocalTriton,
    user_folder: Path,
    tmp_path: Path,
    cat_jpeg: bytes,
    coffee_jpeg: bytes,
) -> None:
    """Lite2 in the user's Triton as it is (float32 NCHW, normalised input, logits), declared by
    its arithmetic alone: its size, layout, names and labels come from Triton; the gateway's answers
    are the derived graph's (the same file through ``triton-repo``), score for score."""
    own = {"backend": "triton", "triton_model": "lite2-nchw", "triton_url": declared_triton.grpc_url}
    own |= {"scale": 1.0, "mean": [127.0] * 3, "std": [128.0] * 3, "output": "logits"}
    models = tmp_path / "models.toml"
    models.write_text(_declared_file(user_folder, declared_triton.grpc_url) + "[models.own]\n" + _toml(own))
    async with running_gateway(gateway_factory(models_file=models)) as client:
        listed = (await client.get("/v1/models")).json()["models"]
        assert [(m["name"], m["ready"]) for m in listed] == [("cars", True), ("own", True)]
        answers = {}
        for model in ("cars", "own"):
            for name, photo in (("cat", cat_jpeg), ("coffee", coffee_jpeg)):
                response = await client.post(f"/v1/models/{model}/classify?top_k=5", content=photo, headers=JPEG)
                assert response.status_code == 200, response.text
                answers[model, name] = response.json()["results"][0]["labels"]
    assert answers["own", "cat"][0]["index"] in CAT_CLASSES
    assert (answers["own", "coffee"][0]["index"], answers["own", "coffee"][0]["label"]) == (ESPRESSO, "espresso")
    for name in ("cat", "coffee"):
        ours, theirs = answers["own", name], answers["cars", name]
        assert [a["label"] for a in ours] == [a["label"] for a in theirs]
        np.testing.assert_allclose([a["score"] for a in ours], [a["score"] for a in theirs], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_what_triton_says_completes_the_declaration(declared_triton: LocalTriton, protocol: str) -> None:
    """Input size, layout, element type, tensor names from the metadata; labels, by index, from
    the classification extension (a label with a colon kept whole)."""
    url = declared_triton.grpc_url if protocol == "grpc" else declared_triton.http_url
    settings = Settings(triton_url=url, triton_protocol=protocol, triton_model="lite2-nchw")
    keys = {"scale": 1.0, "mean": 127.0, "std": 128.0, "output": "logits"}
    profile = complete_on_triton(_declaration(keys), settings, name="m", version="1")
    assert profile.source is not None
    assert (profile.input_size, profile.output, profile.outputs) == ((260, 260), "logits", 1000)
    assert (profile.source.format, profile.source.file, profile.source.input_name, profile.source.output_name) == (
        "triton",
        None,
        "input",
        "output",
    )
    arithmetic = profile.source.arithmetic
    assert (arithmetic.layout, arithmetic.dtype, arithmetic.mean, arithmetic.std) == (
        "NCHW",
        "float32",
        (127.0,) * 3,
        (128.0,) * 3,
    )
    assert profile.labels == imagenet_labels()


def _declaration(keys: dict[str, Any]) -> Any:
    return parse_declaration(keys, WHERE, base=Path.cwd(), root=None)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
async def test_the_backend_sends_the_models_own_dtype_and_layout(declared_triton: LocalTriton, protocol: str) -> None:
    """The tiny model answers the mean of each channel it received: the declared arithmetic (BGR,
    scale, mean, std, NCHW float32) done by the gateway, and the softmax after it."""
    url = declared_triton.grpc_url if protocol == "grpc" else declared_triton.http_url
    settings = Settings(triton_url=url, triton_protocol=protocol, triton_model="tiny")
    keys = {"color": "BGR", "scale": 1 / 255, "mean": [0.1, 0.2, 0.3], "std": [0.5, 0.25, 2.0], "output": "logits"}
    profile = complete_on_triton(_declaration(keys), settings, name="m", version="1")
    assert profile.labels == tuple(TINY_LABELS)
    rgb = np.random.default_rng(1).integers(0, 256, (5, 8, 6, 3), dtype=np.uint8)
    backend = TritonBackend(url=url, model="tiny", protocol=protocol, input_size=(8, 6), classes=4, declared=profile)
    await backend.start()
    try:
        assert await backend.ready() is None
        got = await backend.infer(rgb, timeout=10)
    finally:
        await backend.aclose()
    x = (rgb[..., ::-1].astype(np.float64) / 255 - [0.1, 0.2, 0.3]) / [0.5, 0.25, 2.0]
    logits = np.concatenate([x.mean(axis=(1, 2)), np.zeros((5, 1))], 1)
    expected = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
async def test_concurrent_batches_of_uint8_pixels_each_reach_triton_as_they_are(
    declared_triton: LocalTriton, protocol: str
) -> None:
    """A model that takes the gateway's pixels as they are (uint8 NHWC RGB, its own names): the
    batch sent is the worker thread's own buffer, so it is serialised there, before that thread
    assembles the next batch into it. Many batches at once: each answer is its own batch's."""
    url = declared_triton.grpc_url if protocol == "grpc" else declared_triton.http_url
    settings = Settings(triton_url=url, triton_protocol=protocol, triton_model="tiny-uint8")
    profile = complete_on_triton(_declaration({"output": "embedding"}), settings, name="m", version="1")
    assert profile.source is not None
    assert (profile.source.arithmetic.dtype, profile.source.arithmetic.layout) == ("uint8", "NHWC")
    backend = TritonBackend(
        url=url, model="tiny-uint8", protocol=protocol, input_size=(8, 6), classes=4, declared=profile
    )
    await backend.start()
    try:
        batches = [np.full((4, 8, 6, 3), [k, 255 - k, k // 2], np.uint8) for k in range(64)]
        answers = await asyncio.gather(*(backend.infer(list(b), timeout=30) for b in batches))
    finally:
        await backend.aclose()
    for k, answer in enumerate(answers):
        np.testing.assert_array_equal(answer, np.tile([k, 255 - k, k // 2, 0], (4, 1)).astype(np.float32))


async def test_a_declaration_that_says_enough_starts_without_triton_and_is_checked_when_ready(
    declared_triton: LocalTriton,
) -> None:
    """Input size, layout, element type and labels declared: no call to Triton at start (its
    address may be down); the readiness check then completes it from Triton's metadata: a wrong
    layout is a problem naming the key (and a batch is refused, 503), the right one learns the
    tensor names and serves."""
    keys = {"input_size": [8, 6], "input_dtype": "float32", "labels": TINY_LABELS}
    down = Settings(triton_url=f"127.0.0.1:{free_ports(1)[0]}", triton_model="tiny")
    started = time.monotonic()
    wrong = complete_on_triton(_declaration({**keys, "layout": "NHWC"}), down, name="m", version="1")
    right = complete_on_triton(_declaration({**keys, "layout": "NCHW"}), down, name="m", version="1")
    assert time.monotonic() - started < 1
    assert right.source is not None
    assert (right.source.input_name, right.source.output_name) == ("", "")
    url = declared_triton.grpc_url
    for profile, problem in ((wrong, r"model 'tiny' on Triton: layout: \"NHWC\" declared.*is NCHW"), (right, None)):
        backend = TritonBackend(url=url, model="tiny", input_size=(8, 6), classes=4, declared=profile)
        await backend.start()
        try:
            if problem is None:
                got = await backend.infer(np.zeros((1, 8, 6, 3), np.uint8), timeout=10)  # names learnt first
                assert got.shape == (1, 4)
                assert await backend.ready() is None
            else:
                said = await backend.ready()
                assert said is not None
                assert re.search(problem, said)
                with pytest.raises(BackendUnavailable, match=problem):  # its batches refused, not sent
                    await backend.infer(np.zeros((1, 8, 6, 3), np.uint8), timeout=10)
        finally:
            await backend.aclose()


HOSTILE = [
    ("two-inputs", {}, r"triton_model: the model takes 2 inputs \('pixels'.*'mask'.*\); the gateway feeds one"),
    ("any-channels", {}, r"layout: the model's input 'pixels' \[\?, \?, 8, 6\] float32 has a dynamic channel count"),
    ("short-labels", {}, r"labels: model 'short-labels' on Triton: its label_filename gives labels for 3 of its 4"),
    ("tiny", {"labels": ["a", "b", "c"]}, r"labels: 3 labels for 4 outputs \(the model's output 'logits'"),
    ("tiny", {"input_size": [9, 9]}, r"input_size: \[9, 9\] declared; the model's input 'pixels'.* takes height 8"),
    ("tiny", {"input_dtype": "float16"}, r"input_dtype: \"float16\" declared; the model's input 'pixels'.*float32"),
    ("tiny", {"layout": "NHWC"}, r"layout: \"NHWC\" declared \(channels on axis 3\); .* is NCHW"),
    ("tiny", {"max_batch_size": 64}, r"max_batch_size: 64; the model 'tiny' on Triton takes batches of at most 16"),
    ("tiny", {"triton_shared_memory": True}, r"triton_shared_memory: .* sent over the socket"),
    ("nope", {}, r"triton_model: Triton at 127\.0\.0\.1:\d+ has no model 'nope' \(it has: .*tiny.*\)"),
]


@pytest.mark.parametrize(("model", "keys", "error"), HOSTILE, ids=[f"{m}-{'-'.join(k)}" for m, k, _ in HOSTILE])
def test_what_triton_says_against_the_declaration_is_a_start_up_error(
    declared_triton: LocalTriton, tmp_path: Path, model: str, keys: dict[str, Any], error: str
) -> None:
    """A models file's model that Triton's metadata contradicts, or that Triton does not have:
    refused at start by model, version and key, with both values."""
    table = {"backend": "triton", "triton_model": model, "triton_url": declared_triton.grpc_url, "output": "logits"}
    table |= keys
    started = time.monotonic()
    with pytest.raises(CatalogError, match=r"^models\.toml: model 'own' version '1': " + error):
        _catalog("[models.own]\n" + _toml(table), tmp_path)
    assert time.monotonic() - started < 5  # not waited for: Triton answered


def test_an_unreachable_triton_is_waited_for_then_a_clear_error() -> None:
    """Nothing listening: asked again for the bounded wait, then the error names the key, the
    address, what the connection said, and the way to start without asking Triton."""
    port = free_ports(1)[0]
    settings = Settings(triton_url=f"127.0.0.1:{port}", triton_model="tiny")
    started = time.monotonic()
    with pytest.raises(DeclarationError) as caught:
        complete_on_triton(_declaration({"output": "logits"}), settings, name="m", version="1", wait=1.5)
    assert 1.5 <= time.monotonic() - started < 6
    message = str(caught.value)
    assert message.startswith(f"{WHERE}: triton_url: Triton at 127.0.0.1:{port} does not answer (")
    assert "after waiting 1.5 s; start it first, or declare input_size, layout, input_dtype and labels" in message


def test_a_triton_still_starting_is_waited_for(triton_install: TritonInstall, tmp_path: Path) -> None:
    """Triton started after the gateway began asking: the declaration is completed once it is up."""
    repository = tmp_path / "repo"
    _python_model(repository, "tiny", [("pixels", "TYPE_FP32", [3, 8, 6])], [("logits", "TYPE_FP32", [4])], TINY)
    ports = Ports(*free_ports(3))
    server = LocalTriton(triton_install, repository, ports, log=tmp_path / "triton.log")
    later = threading.Timer(1.0, server.start, kwargs={"timeout": 90})
    later.start()
    try:
        settings = Settings(triton_url=server.grpc_url, triton_model="tiny")
        keys = {"output": "embedding"}
        profile = complete_on_triton(_declaration(keys), settings, name="m", version="1", wait=90)
        assert (profile.input_size, profile.outputs) == ((8, 6), 4)
    finally:
        later.join()
        server.stop()
