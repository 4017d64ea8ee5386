"""What a model gives, through every surface: an embedding model's vectors by POST .../embed (JSON
and float32 rows), a sigmoid model's labels at or above its threshold (top_k caps), each route
refusing the other kind with a 400 that names the right one, the Open Inference Protocol's tensor,
and the model's metadata. Real models: tiny ONNX graphs (uint8 NHWC in, float32 [N, D] out) served
by ONNX Runtime (the embedded backend)."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from service.models.profiles import ModelProfile
from service.models.tensors import INPUT_NAME, OUTPUT_NAME
from service.serving.catalog import Catalog, ModelSpec, VersionSpec
from service.settings import Settings
from service.settings.model import ModelSettings
from tests.conftest import png_bytes, running_gateway

SIDE = 32
DIMENSIONS = 48
TAGS = 24
"""More than the batcher ranks per batch (20): the protocol's classification of every tag takes
them from the whole row."""


def _graph(name: str, nodes: list[onnx.NodeProto], consts: dict[str, np.ndarray], width: int) -> onnx.ModelProto:
    """uint8 [N, SIDE, SIDE, 3] -> the per-channel means ``m`` [N, 3] -> ``nodes`` -> float32 [N, width]."""
    head = [
        helper.make_node("Cast", [INPUT_NAME], ["x"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMean", ["x"], ["m"], axes=[1, 2], keepdims=0),
    ]
    graph = helper.make_graph(
        head + nodes,
        name,
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.UINT8, ["N", SIDE, SIDE, 3])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["N", width])],
        [numpy_helper.from_array(value, key) for key, value in consts.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def embedder_graph() -> onnx.ModelProto:
    """Each image's channel means, tiled to 48 numbers, times 1/7 .. 48/7, less 100."""
    consts: dict[str, np.ndarray] = {
        "repeats": np.array([1, DIMENSIONS // 3], np.int64),
        "w": ((np.arange(DIMENSIONS) + 1) / 7).astype(np.float32),
        "b": np.array([100], np.float32),
    }
    nodes = [
        helper.make_node("Tile", ["m", "repeats"], ["t"]),
        helper.make_node("Mul", ["t", "w"], ["s"]),
        helper.make_node("Sub", ["s", "b"], [OUTPUT_NAME]),
    ]
    return _graph("embedder", nodes, consts, DIMENSIONS)


def tagger_graph() -> onnx.ModelProto:
    """Tag j's score is sigmoid((red - 10 j) / 8): a red of 100 puts tags 0-10 at or above 0.5
    (tag 10 at 0.5 itself), a red of 8 tag 0 alone."""
    consts: dict[str, np.ndarray] = {
        "starts": np.array([0], np.int64),
        "ends": np.array([1], np.int64),
        "axes": np.array([1], np.int64),
        "repeats": np.array([1, TAGS], np.int64),
        "offsets": (10 * np.arange(TAGS)).astype(np.float32),
        "scale": np.array([0.125], np.float32),
    }
    nodes = [
        helper.make_node("Slice", ["m", "starts", "ends", "axes"], ["red"]),
        helper.make_node("Tile", ["red", "repeats"], ["t"]),
        helper.make_node("Sub", ["t", "offsets"], ["d"]),
        helper.make_node("Mul", ["d", "scale"], ["z"]),
        helper.make_node("Sigmoid", ["z"], [OUTPUT_NAME]),
    ]
    return _graph("tagger", nodes, consts, TAGS)


EMBEDDER = ModelProfile(
    "test-embedder", "1", (SIDE, SIDE), 0.875, 1, lambda weights: embedder_graph(), output="embedding",
    dimensions=DIMENSIONS,
)  # fmt: skip
TAGGER = ModelProfile(
    "test-tagger", "1", (SIDE, SIDE), 0.875, 1, lambda weights: tagger_graph(), output="sigmoid", threshold=0.5,
    label_names=tuple(f"tag-{j}" for j in range(TAGS)),
)  # fmt: skip


def settings_for(models_dir: Path, **overrides: object) -> Settings:
    return Settings(models_dir=models_dir, **overrides)  # type: ignore[arg-type]


def catalog_of(settings: Settings, *models: tuple[str, ModelProfile]) -> Catalog:
    """One version ("1") of each model, the first the default."""
    specs = tuple(
        ModelSpec(
            name, (VersionSpec("1", profile, ModelSettings.of(settings), settings, 1.0),), share=1.0, sticky=False
        )
        for name, profile in models
    )
    return Catalog(specs, default=specs[0].name)


def rows(graph: onnx.ModelProto, *colours: tuple[int, int, int]) -> np.ndarray:
    """What ONNX Runtime gives for solid images of these colours (a solid image stays itself
    through the gateway's resize and crop)."""
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    batch = np.stack([np.full((SIDE, SIDE, 3), colour, np.uint8) for colour in colours])
    (out,) = session.run([OUTPUT_NAME], {INPUT_NAME: batch})
    return np.asarray(out, np.float32)


def solid_png(colour: tuple[int, int, int]) -> bytes:
    return png_bytes(np.full((40, 40, 3), colour, np.uint8))


RED, TEAL = (200, 30, 10), (5, 120, 240)


@pytest.fixture
def both(tmp_path: Path) -> tuple[Settings, Catalog]:
    """The embedding model (the default) and the sigmoid one, on ONNX Runtime."""
    settings = settings_for(tmp_path, max_batch_size=8)
    return settings, catalog_of(settings, ("emb", EMBEDDER), ("tags", TAGGER))


def error_of(response: httpx.Response) -> tuple[int, str]:
    body = response.json()
    assert body["detail"], body
    return response.status_code, body["error"]


async def test_embed_answers_the_backends_rows_in_json_and_in_binary(both: tuple[Settings, Catalog]) -> None:
    """Two images in one multipart body: JSON with the model, each filename, its dimensions and its
    vector, equal as float32 to what ONNX Runtime gives; with ``Accept: application/octet-stream``
    the same numbers as little-endian float32 rows, their shape in a header; a raw body and the
    versioned route answer the same."""
    expected = rows(embedder_graph(), RED, TEAL)
    files = [("file", ("red.png", solid_png(RED), "image/png")), ("file", ("teal.png", solid_png(TEAL), "image/png"))]
    async with running_gateway(both[0], catalog=both[1]) as client:
        answer = await client.post("/v1/models/emb/embed", files=files)
        binary = await client.post("/v1/models/emb/embed", files=files, headers={"accept": "application/octet-stream"})
        raw = await client.post(
            "/v1/models/emb/versions/1/embed", content=solid_png(TEAL), headers={"content-type": "image/png"}
        )
        preferred = await client.post(
            "/v1/models/emb/embed",
            files=files,
            headers={"accept": "application/json;q=0.5, application/octet-stream;q=0.9"},
        )
        refused_binary = await client.post(
            "/v1/models/emb/embed", files=files, headers={"accept": "application/octet-stream;q=0, */*"}
        )
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    body = answer.json()
    assert body["model"] == {"name": "emb", "version": "1", "random_weights": False}
    assert [(e["filename"], e["dimensions"]) for e in body["embeddings"]] == [("red.png", 48), ("teal.png", 48)]
    vectors = np.array([e["vector"] for e in body["embeddings"]], np.float64)
    assert np.array_equal(vectors.astype(np.float32), expected)  # 9 digits give each float32 back exactly
    assert not np.array_equal(expected[0], expected[1])

    assert binary.status_code == 200, binary.text
    assert binary.headers["content-type"] == "application/octet-stream"
    assert binary.headers["x-embedding-shape"] == "2,48"
    assert (binary.headers["x-model-name"], binary.headers["x-model-version"]) == ("emb", "1")
    assert binary.content == expected.astype("<f4").tobytes()
    assert preferred.content == binary.content
    assert refused_binary.headers["content-type"] == "application/json"

    assert raw.status_code == 200, raw.text
    (only,) = raw.json()["embeddings"]
    assert only["filename"] is None
    assert np.array_equal(np.array(only["vector"], np.float32), expected[1])


async def test_each_route_refuses_the_other_kind_naming_the_right_route(both: tuple[Settings, Catalog]) -> None:
    """/classify of an embedding model (named or the default) is 400 not_a_classifier naming its
    /embed, before its body is read (a bad image makes no difference); /embed of a sigmoid model is
    400 not_an_embedding_model naming its /classify; the protocol's classification of an embedding
    model is a 400 in the protocol's shape."""
    png = {"content": solid_png(RED), "headers": {"content-type": "image/png"}}
    async with running_gateway(both[0], catalog=both[1]) as client:
        named = await client.post("/v1/models/emb/classify", **png)  # type: ignore[arg-type]
        default = await client.post("/classify", **png)  # type: ignore[arg-type]
        unread = await client.post("/v1/models/emb/classify", content=b"", headers={"content-type": "image/png"})
        embed_tags = await client.post("/v1/models/tags/versions/1/embed", **png)  # type: ignore[arg-type]
        v2 = await client.post(
            "/v2/models/emb/infer",
            json={
                "inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": [_b64(solid_png(RED))]}],
                "outputs": [{"name": "PROBABILITIES", "parameters": {"classification": 3}}],
            },
        )
    for refused in (named, default, unread):
        assert error_of(refused) == (400, "not_a_classifier")
        assert "POST /v1/models/emb/embed" in refused.json()["detail"]
    assert error_of(embed_tags) == (400, "not_an_embedding_model")
    assert "POST /v1/models/tags/classify" in embed_tags.json()["detail"]
    assert v2.status_code == 400
    assert set(v2.json()) == {"error"}
    assert "/v1/models/emb/embed" in v2.json()["error"]


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


def _above(row: np.ndarray, threshold: float) -> list[int]:
    """The tags at or above the threshold, best first (ties: lower index first)."""
    order = sorted(range(len(row)), key=lambda j: (-row[j], j))
    return [j for j in order if row[j] >= np.float32(threshold)]


@pytest.mark.parametrize(
    ("red", "top_k", "count"),
    [(100, None, 5), (100, 20, 11), (100, 3, 3), (255, 20, 20), (8, 20, 1), (8, 1, 1)],
    ids=["default-cap", "threshold-under-top-k", "top-k-3", "all-above", "one-above", "one-above-k1"],
)
async def test_a_sigmoid_model_answers_the_labels_at_or_above_its_threshold(
    both: tuple[Settings, Catalog], red: int, top_k: int | None, count: int
) -> None:
    """Every tag whose score is at or above 0.5, best first, at most top_k (default 5): a red of
    100 has 11 such tags (tag 10 at 0.5 itself), 255 all 24, 8 one."""
    (row,) = rows(tagger_graph(), (red, 0, 0))
    wanted = _above(row, 0.5)[: top_k or 5]
    assert len(wanted) == count  # the model is what this test takes it to be
    params = {"top_k": top_k} if top_k is not None else {}
    async with running_gateway(both[0], catalog=both[1]) as client:
        answer = await client.post(
            "/v1/models/tags/classify",
            params=params,
            content=solid_png((red, 0, 0)),
            headers={"content-type": "image/png"},
        )
    assert answer.status_code == 200, answer.text
    labels = answer.json()["results"][0]["labels"]
    assert [label["index"] for label in labels] == wanted
    assert [label["label"] for label in labels] == [f"tag-{j}" for j in wanted]
    assert all(label["score"] >= 0.5 for label in labels)
    assert [label["score"] for label in labels] == [float(row[j]) for j in wanted]


async def test_the_protocol_gives_each_models_own_tensor(both: tuple[Settings, Catalog]) -> None:
    """/v2: an embedding model's metadata says FP32 [-1, 48] and its answer is the [N, 48] rows;
    the sigmoid model's classification of all 24 tags (more than the batcher ranks) gives all of
    them, whatever their score, best first."""
    images = [_b64(solid_png(RED)), _b64(solid_png(TEAL))]
    request = {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [2], "data": images}]}
    async with running_gateway(both[0], catalog=both[1]) as client:
        meta = (await client.get("/v2/models/emb")).json()
        tags_meta = (await client.get("/v2/models/tags")).json()
        tensor = await client.post("/v2/models/emb/infer", json=request)
        ranked = await client.post(
            "/v2/models/tags/infer",
            json={**request, "outputs": [{"name": "PROBABILITIES", "parameters": {"classification": TAGS}}]},
        )
    assert meta["outputs"] == [{"name": "PROBABILITIES", "datatype": "FP32", "shape": [-1, DIMENSIONS]}]
    assert (meta["parameters"]["output"], meta["parameters"]["input_size"]) == ("embedding", [SIDE, SIDE])
    assert tags_meta["outputs"][0]["shape"] == [-1, TAGS]
    assert tensor.status_code == 200, tensor.text
    (output,) = tensor.json()["outputs"]
    assert (output["datatype"], output["shape"]) == ("FP32", [2, DIMENSIONS])
    got = np.array(output["data"], np.float64).astype(np.float32).reshape(2, DIMENSIONS)
    assert np.array_equal(got, rows(embedder_graph(), RED, TEAL))
    assert ranked.status_code == 200, ranked.text
    (classes,) = ranked.json()["outputs"]
    assert classes["shape"] == [2, TAGS]
    (red_row, _) = rows(tagger_graph(), RED, TEAL)
    first = [int(element.split(":")[1]) for element in classes["data"][:TAGS]]
    assert first == sorted(range(TAGS), key=lambda j: (-red_row[j], j))


async def test_model_metadata_says_what_the_model_takes_and_gives(both: tuple[Settings, Catalog]) -> None:
    """GET /v1/models/{name}: input size, resize, output kind, dimensions; the threshold for a
    sigmoid model; labels for a classifier only."""
    async with running_gateway(both[0], catalog=both[1]) as client:
        (emb,) = (await client.get("/v1/models/emb")).json()["versions"]
        (tags,) = (await client.get("/v1/models/tags")).json()["versions"]
    assert {
        k: emb[k] for k in ("input_size", "image_size", "resize", "output", "dimensions", "threshold", "labels")
    } == {
        "input_size": [SIDE, SIDE],
        "image_size": SIDE,
        "resize": "crop",
        "output": "embedding",
        "dimensions": DIMENSIONS,
        "threshold": None,
        "labels": None,
    }
    assert (tags["output"], tags["threshold"], tags["dimensions"]) == ("sigmoid", 0.5, TAGS)
    assert tags["labels"] == [f"tag-{j}" for j in range(TAGS)]


MULTIPART = "multipart/form-data; boundary=x"
BAD_BODIES = [
    ({"content": b"", "headers": {"content-type": "image/png"}}, "empty"),
    ({"content": b"plain text", "headers": {"content-type": "image/png"}}, "text-as-png"),
    ({"content": b"plain text", "headers": {"content-type": "text/plain"}}, "text-content-type"),
    ({"files": {"photo": ("a.png", b"x", "image/png")}}, "wrong-field"),
    ({"files": {"file": ("a.txt", b"hello", "text/plain")}}, "text-part"),
    ({"content": b"--x\r\nnot multipart", "headers": {"content-type": MULTIPART}}, "bad-multipart"),
    ({"content": b'{"images": [{"url": 5}]}', "headers": {"content-type": "application/json"}}, "bad-json"),
    ({"content": b'{"images": []', "headers": {"content-type": "application/json"}}, "truncated-json"),
    ({"files": [("file", ("é" * 128 + ".png", solid_png(RED), "image/png"))]}, "long-filename"),
]  # fmt: skip


@pytest.mark.parametrize("kwargs", [b[0] for b in BAD_BODIES], ids=[b[1] for b in BAD_BODIES])
async def test_embed_refuses_bad_bodies_as_classify_does(
    both: tuple[Settings, Catalog], kwargs: dict[str, object]
) -> None:
    """/embed reads its body with /classify's code: each bad body gets the same status, error code
    and detail from both (the sigmoid model's /classify beside the embedding model's /embed)."""
    async with running_gateway(both[0], catalog=both[1]) as client:
        embedded = await client.post("/v1/models/emb/embed", **kwargs)  # type: ignore[arg-type]
        classified = await client.post("/v1/models/tags/classify", **kwargs)  # type: ignore[arg-type]
    assert embedded.status_code in (400, 413, 415), embedded.text
    assert error_of(embedded) == error_of(classified)
    assert embedded.json()["detail"] == classified.json()["detail"]


def test_the_batcher_ranks_no_embedding() -> None:
    """An embedding model's batches are not ranked (no sort per batch for a vector): the batcher's
    rows are the score rows themselves; a classifier's are ranked."""
    from service.classifier import Scored, rank_for

    scores = np.arange(12, dtype=np.float32).reshape(3, 4)
    embedded = [row for row in rank_for(EMBEDDER)(scores) if type(row) is np.ndarray]
    assert len(embedded) == 3
    assert np.array_equal(np.stack(embedded), scores)
    ranked = [row for row in rank_for(TAGGER)(scores) if isinstance(row, Scored)]
    assert len(ranked) == 3
    assert ranked[0].ranked[0] == (3, 3.0)


async def test_embed_takes_mode_and_no_top_k(both: tuple[Settings, Catalog]) -> None:
    """/embed's query parameters: top_k (a classification's) is a 422 naming what it takes; an
    unknown mode a 422; an unknown model a 404."""
    png = {"content": solid_png(RED), "headers": {"content-type": "image/png"}}
    async with running_gateway(both[0], catalog=both[1]) as client:
        top_k = await client.post("/v1/models/emb/embed", params={"top_k": 3}, **png)  # type: ignore[arg-type]
        mode = await client.post("/v1/models/emb/embed", params={"mode": "later"}, **png)  # type: ignore[arg-type]
        unknown = await client.post("/v1/models/nope/embed", **png)  # type: ignore[arg-type]
    assert error_of(top_k) == (422, "invalid_parameters")
    assert "top_k" in top_k.json()["detail"]
    assert "this route takes: mode" in top_k.json()["detail"]
    assert error_of(mode) == (422, "invalid_parameters")
    assert error_of(unknown) == (404, "not_found")


async def test_openapi_describes_the_embed_routes(tmp_path: Path) -> None:
    """Both /embed routes are in the OpenAPI schema: the bodies /classify takes, mode (not top_k),
    the JSON answer and the binary one, and the errors."""
    settings = settings_for(tmp_path, backend="fake")
    async with running_gateway(settings, catalog=catalog_of(settings, ("emb", EMBEDDER))) as client:
        schema = (await client.get("/openapi.json")).json()
    for path in ("/v1/models/{name}/embed", "/v1/models/{name}/versions/{version}/embed"):
        post = schema["paths"][path]["post"]
        assert {"multipart/form-data", "image/png", "application/json"} <= set(post["requestBody"]["content"])
        names = {p["name"] for p in post["parameters"]}
        assert "mode" in names
        assert "top_k" not in names
        assert {"application/json", "application/octet-stream"} <= set(post["responses"]["200"]["content"])
        assert {"200", "202", "400", "404", "413", "415", "422", "429"} <= set(post["responses"])
    answer = schema["components"]["schemas"]["EmbedResponse"]
    assert set(answer["properties"]) == {"model", "embeddings"}


async def test_an_embedding_of_the_fake_backend_is_its_row(tmp_path: Path) -> None:
    """A declared width reaches the backend: the fake backend gives ``dimensions`` numbers, one-hot
    on the image's red value, and /embed answers that row (JSON: ``dimensions`` 64)."""
    settings = settings_for(tmp_path, backend="fake")
    profile = ModelProfile(
        "fake-embedder", "1", (SIDE, SIDE), 0.875, 1, lambda weights: embedder_graph(), output="embedding",
        dimensions=64,
    )  # fmt: skip
    async with running_gateway(settings, catalog=catalog_of(settings, ("emb", profile))) as client:
        answer = await client.post(
            "/v1/models/emb/embed", content=solid_png((70, 0, 0)), headers={"content-type": "image/png"}
        )
    assert answer.status_code == 200, answer.text
    (embedding,) = answer.json()["embeddings"]
    assert embedding["dimensions"] == 64
    assert embedding["vector"] == [1.0 if i == 70 % 64 else 0.0 for i in range(64)]
