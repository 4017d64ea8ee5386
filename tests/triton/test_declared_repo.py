"""``gateway models triton-repo`` with a models file: declared models written as Triton models
(their derived graph, the gateway's wire in and out, a classifier's labels beside the config),
checked against Triton's own ModelConfig schema; what cannot be written is refused by model and
version. (tests/serving/test_triton_declared.py serves what it writes on a real Triton.)"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from service.cli import main
from service.serving.catalog import parse_catalog
from service.settings import Settings
from service.triton.declared_repo import RepositoryRefused, write_catalog
from service.triton.repository import TritonOptions
from tests.models.exports import tiny_model


def parse(path: Path) -> mc.ModelConfig:
    return text_format.Parse(path.read_text(), mc.ModelConfig())


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """Two small user models: NCHW float32 of 5x7 with 3 outputs, NHWC of 9x9 with 4; and one of batch 1."""
    onnx.save(tiny_model(["N", 3, 5, 7], outputs=3), tmp_path / "a.onnx")
    onnx.save(tiny_model(["N", 9, 9, 3], outputs=4), tmp_path / "b.onnx")
    onnx.save(tiny_model([1, 3, 5, 7], outputs=3), tmp_path / "one.onnx")
    (tmp_path / "a.txt").write_text("cat\ndog\nbird: with a colon\n")
    return tmp_path


def write(folder: Path, toml: str, **options: object) -> tuple[list[Path], list[str]]:
    (folder / "models.toml").write_text(toml)
    import tomllib

    settings = Settings(models_dir=folder / "built", max_batch_size=8)
    catalog = parse_catalog(tomllib.loads(toml), settings, "models.toml", base=folder)
    from service.models.store import ensure_model

    return write_catalog(
        folder / "repo",
        catalog,
        TritonOptions(variant="python", max_batch_size=16, **options),  # type: ignore[arg-type]
        lambda e: ensure_model(folder / "built", e.profile) if e.profile.source is not None else None,
    )


def test_a_declared_classifier_takes_the_wire_and_carries_its_labels(folder: Path) -> None:
    (model_dir,), notes = write(folder, '[models.cars]\npath = "a.onnx"\nlabels = "a.txt"\noutput = "logits"\n')
    assert notes == []
    config = parse(model_dir / "config.pbtxt")
    (inp,) = config.input
    assert (inp.name, inp.data_type, list(inp.dims)) == ("images", mc.TYPE_UINT8, [5, 7, 3])
    (out,) = config.output
    assert (out.name, out.data_type, list(out.dims), out.label_filename) == ("scores", mc.TYPE_FP32, [3], "labels.txt")
    assert (model_dir / "labels.txt").read_text() == "cat\ndog\nbird: with a colon\n"
    assert config.max_batch_size == 16
    assert (config.backend, config.version_policy.latest.num_versions) == ("python", 1)
    derived = onnx.load(model_dir / "1" / "model.onnx")
    assert [i.name for i in derived.graph.input] == ["images"]
    assert "class TritonPythonModel" in (model_dir / "1" / "model.py").read_text()


def test_an_embedding_has_no_labels_and_its_width(folder: Path) -> None:
    (model_dir,), _ = write(folder, '[models.vectors]\npath = "b.onnx"\noutput = "embedding"\n')
    config = parse(model_dir / "config.pbtxt")
    assert list(config.input[0].dims) == [9, 9, 3]
    assert (list(config.output[0].dims), config.output[0].label_filename) == ([4], "")
    assert not (model_dir / "labels.txt").exists()


def test_versions_of_one_triton_model_share_its_config(folder: Path) -> None:
    """Two versions of a model: one Triton model serving both; versions that disagree are refused."""
    (model_dir,), _ = write(
        folder,
        '[models.cars]\nlabels = "a.txt"\n[models.cars.versions.1]\npath = "a.onnx"\n'
        '[models.cars.versions.2]\npath = "a.onnx"\noutput = "logits"\n',
    )
    config = parse(model_dir / "config.pbtxt")
    assert list(config.version_policy.specific.versions) == [1, 2]
    assert (model_dir / "1" / "model.onnx").is_file()
    assert (model_dir / "2" / "model.onnx").is_file()
    with pytest.raises(RepositoryRefused, match=r"model 'mixed' version '2'.*share its config"):
        write(
            folder,
            '[models.mixed.versions.1]\npath = "a.onnx"\nlabels = "a.txt"\n'
            '[models.mixed.versions.2]\npath = "b.onnx"\noutput = "embedding"\n',
        )


def test_a_model_of_one_image_at_a_time_is_written_so(folder: Path) -> None:
    """A graph of batch 1: Triton's max_batch_size 1, so its batcher never forms a larger one."""
    toml = '[models.single]\npath = "one.onnx"\nlabels = "a.txt"\nmax_batch_size = 1\n'
    (model_dir,), _ = write(folder, toml)
    config = parse(model_dir / "config.pbtxt")
    assert config.max_batch_size == 1
    assert not config.dynamic_batching.preferred_batch_size


def test_a_model_in_triton_is_left_out_and_an_ir_refused(folder: Path) -> None:
    toml = (
        '[models.cars]\npath = "a.onnx"\nlabels = "a.txt"\n'
        '[models.theirs]\nbackend = "triton"\ninput_size = 8\nlayout = "NCHW"\ninput_dtype = "float32"\n'
        'labels = ["x"]\ntriton_url = "127.0.0.1:1"\n'
    )
    written, notes = write(folder, toml)
    assert [p.name for p in written] == ["cars"]
    assert notes == ["model 'theirs' version '1': left out (a model already in your Triton)"]
    import openvino as ov

    ov.save_model(ov.convert_model(folder / "a.onnx"), str(folder / "a.xml"))
    with pytest.raises(
        RepositoryRefused,
        match=r"model 'ir' version '1': a.xml is an OpenVINO IR; the triton backend serves a declared .onnx",
    ):
        write(folder, '[models.ir]\npath = "a.xml"\nlabels = "a.txt"\nbackend = "openvino"\n')


def test_the_command_writes_a_models_files_models(
    folder: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``gateway models triton-repo --models-file``: each model folder printed; ``--all`` with a
    models file is refused (it means the built-in profiles)."""
    monkeypatch.chdir(folder)
    (folder / "models.toml").write_text('[models.cars]\npath = "a.onnx"\nlabels = "a.txt"\n')
    common = ["models", "triton-repo", "--models-file", "models.toml", "--models-dir", "built", "--out", "repo"]
    assert main([*common, "--variant", "onnxruntime"]) == 0
    assert capsys.readouterr().out.split() == [str(Path("repo") / "cars")]
    config = parse(folder / "repo" / "cars" / "config.pbtxt")
    assert (config.platform, list(config.output[0].dims)) == ("onnxruntime_onnx", [3])
    session_input = onnx.load(folder / "repo" / "cars" / "1" / "model.onnx").graph.input[0]
    assert session_input.type.tensor_type.elem_type == onnx.TensorProto.UINT8
    assert main([*common, "--all"]) == 2
    assert "--all writes the built-in profiles" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["../escape", "/tmp/escape", ".", "..", "a/b", "", "x" * 256, "a b"])
def test_a_triton_model_name_that_is_not_a_folder_name_is_refused(
    folder: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """``triton_model = "../escape"`` (or absolute, or with a separator) is refused as a setting,
    by name, and nothing is written outside --out."""
    monkeypatch.chdir(folder)
    (folder / "models.toml").write_text(f'[models.cars]\npath = "a.onnx"\nlabels = "a.txt"\ntriton_model = "{name}"\n')
    common = ["models", "triton-repo", "--models-file", "models.toml", "--models-dir", "built", "--out", "repo"]
    with pytest.raises(SystemExit, match=r"model 'cars' version '1': triton_model: .*is not a Triton model name"):
        main([*common, "--variant", "onnxruntime"])
    assert not (folder / "escape").exists()
    with pytest.raises(ValueError, match="is not a Triton model name"):
        Settings(triton_model=name)


def test_a_model_folder_that_resolves_outside_the_repository_is_refused(folder: Path) -> None:
    """The repository's writer refuses a model or version folder outside it, a symlink out of it included."""
    from service.models.profiles import get_profile
    from service.triton.repository import write_model

    repo, outside = folder / "repo", folder / "outside"
    repo.mkdir()
    outside.mkdir()
    (repo / "linked").symlink_to(outside)
    options = TritonOptions(variant="python", max_batch_size=4)
    profile = get_profile("trivial")
    for name, version in (("../escape", None), ("linked", None), ("ok", "../../escape"), (str(outside), None)):
        with pytest.raises(ValueError, match="is not a folder in the Triton repository"):
            write_model(repo, profile, options, None, name, version=version)
    assert list(outside.iterdir()) == []
    assert not (folder / "escape").exists()
