from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from service.images.preprocess import PreprocessConfig, prepare
from service.models import resnet
from service.models.profiles import get_profile, top_k
from service.models.tensors import INPUT_NAME, OUTPUT_NAME
from tests.conftest import CAT_CLASSES, ESPRESSO
from tests.torch_files import write_zip


def _session(model: onnx.ModelProto | Path) -> ort.InferenceSession:
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def lite0(models_dir: Path) -> ort.InferenceSession:
    return _session(models_dir / "efficientnet-lite0" / "1" / "model.onnx")


def test_efficientnet_lite0_classifies_real_photos(
    lite0: ort.InferenceSession, cat_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    """The real ImageNet weights are read and wired right: a cat photo is a cat, an espresso is espresso."""
    batch = np.stack([prepare(cat_jpeg, PreprocessConfig()), prepare(coffee_jpeg, PreprocessConfig())])
    (scores,) = lite0.run([OUTPUT_NAME], {INPUT_NAME: batch})
    assert top_k(scores[0], 1)[0][0] in CAT_CLASSES
    best, score = top_k(scores[1], 1)[0]
    assert best == ESPRESSO
    assert score > 0.5


def test_graph_contract_is_uint8_nhwc_in_probabilities_out(lite0: ort.InferenceSession) -> None:
    (inp,) = lite0.get_inputs()
    (out,) = lite0.get_outputs()
    assert (inp.name, inp.type, inp.shape[1:]) == (INPUT_NAME, "tensor(uint8)", [224, 224, 3])
    assert (out.name, out.type, out.shape[1]) == (OUTPUT_NAME, "tensor(float)", 1000)
    batch = np.random.default_rng(0).integers(0, 256, (3, 224, 224, 3), dtype=np.uint8)
    (scores,) = lite0.run(None, {INPUT_NAME: batch})
    np.testing.assert_allclose(scores.sum(axis=1), 1.0, rtol=1e-5)


@pytest.fixture(scope="module")
def random_resnet() -> dict[str, np.ndarray]:
    return resnet.random_state_dict(seed=0)


def test_resnet50_has_torchvision_names_and_parameter_count(random_resnet: dict[str, np.ndarray]) -> None:
    learnable = sum(v.size for k, v in random_resnet.items() if "running" not in k)
    assert learnable == 25_557_032  # torchvision.models.resnet50
    assert random_resnet["layer3.5.conv2.weight"].shape == (256, 256, 3, 3)
    assert random_resnet["layer4.0.downsample.0.weight"].shape == (2048, 1024, 1, 1)


def test_resnet50_uses_the_given_state_dict(random_resnet: dict[str, np.ndarray], tmp_path: Path) -> None:
    """A torchvision zip-format checkpoint is read and its weights decide the output."""
    state = dict(random_resnet)
    state["fc.weight"] = np.zeros_like(state["fc.weight"])
    bias = np.zeros(1000, np.float32)
    bias[417] = 10.0  # every image becomes class 417 ('balloon')
    state["fc.bias"] = bias
    path = tmp_path / "resnet50.pth"
    write_zip(path, state)
    model = get_profile("resnet50").build(path)
    batch = np.random.default_rng(1).integers(0, 256, (2, 224, 224, 3), dtype=np.uint8)
    (scores,) = _session(model).run(None, {INPUT_NAME: batch})
    assert scores.shape == (2, 1000)
    assert list(scores.argmax(axis=1)) == [417, 417]


def test_top_k_is_sorted_and_bounded() -> None:
    scores = np.array([0.1, 0.5, 0.05, 0.3, 0.05], np.float32)
    assert [i for i, _ in top_k(scores, 3)] == [1, 3, 0]
    assert len(top_k(scores, 20)) == 5
