"""Generated Triton repositories, checked against Triton's own ModelConfig schema (shipped with
tritonclient). The tensorrt variant cannot be served here (no GPU), so its content is checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from service.models.profiles import get_profile
from service.triton.repository import CPU_VARIANTS, VARIANTS, TritonOptions, write_model

ROOT = Path(__file__).resolve().parents[2]


def parse(path: Path) -> mc.ModelConfig:
    return text_format.Parse(path.read_text(), mc.ModelConfig())


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_takes_uint8_nhwc_and_gives_scores(tmp_path: Path, variant: str) -> None:
    profile = get_profile("resnet50")
    options = TritonOptions(
        variant=variant,  # type: ignore[arg-type]
        max_batch_size=48,
        preferred_batch_sizes=(8, 16, 64),
        instances=3,
        max_queue_size=256,
    )
    model_dir = write_model(tmp_path, profile, options, onnx_path=None)
    config = parse(model_dir / "config.pbtxt")
    assert config.name == "resnet50"
    assert config.max_batch_size == 48
    (inp,) = config.input
    assert (inp.name, inp.data_type, inp.format, list(inp.dims)) == (
        "images",
        mc.TYPE_UINT8,
        mc.ModelInput.FORMAT_NHWC,
        [224, 224, 3],
    )
    (out,) = config.output
    assert (out.name, out.data_type, list(out.dims)) == ("scores", mc.TYPE_FP32, [1000])
    batching = config.dynamic_batching
    assert list(batching.preferred_batch_size) == [8, 16]  # sizes over max_batch_size are dropped
    assert batching.max_queue_delay_microseconds == 2000
    assert batching.default_queue_policy.max_queue_size == 256
    (group,) = config.instance_group
    assert group.count == 3
    expected_kind = mc.ModelInstanceGroup.KIND_CPU if variant in CPU_VARIANTS else mc.ModelInstanceGroup.KIND_GPU
    assert group.kind == expected_kind


def test_queue_policy_is_left_out_unless_asked_for(tmp_path: Path) -> None:
    """Triton 2.51 stalls requests ~500 ms at low load when any queue policy is set (see deploy/triton/README.md)."""
    model_dir = write_model(tmp_path, get_profile("trivial"), TritonOptions(variant="python"), onnx_path=None)
    config = parse(model_dir / "config.pbtxt")
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    assert not config.dynamic_batching.HasField("default_queue_policy")


def test_tensorrt_variant_is_a_plan_built_by_trtexec(tmp_path: Path) -> None:
    profile = get_profile("resnet50")
    onnx = tmp_path / "source.onnx"
    onnx.write_bytes(b"onnx bytes")
    options = TritonOptions(variant="tensorrt", max_batch_size=64, preferred_batch_sizes=(8, 16, 32))
    model_dir = write_model(tmp_path / "repo", profile, options, onnx_path=onnx)
    config = parse(model_dir / "config.pbtxt")
    assert (config.platform, config.default_model_filename) == ("tensorrt_plan", "model.plan")
    assert list(config.instance_group[0].gpus) == [0]
    assert (model_dir / "model.onnx").read_bytes() == b"onnx bytes"  # the build input, beside the config
    script = (model_dir / "build_plan.sh").read_text()
    for expected in (
        "trtexec",
        "--onnx=model.onnx",
        "--saveEngine=1/model.plan",
        "--fp16",
        "--minShapes=images:1x224x224x3",
        "--optShapes=images:32x224x224x3",
        "--maxShapes=images:64x224x224x3",
    ):
        assert expected in script
    assert (model_dir / "build_plan.sh").stat().st_mode & 0o111
    result = subprocess.run(["sh", "-n", str(model_dir / "build_plan.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_onnxruntime_and_python_variants_place_the_onnx_file(tmp_path: Path) -> None:
    profile = get_profile("efficientnet-lite0")
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"x")
    ort_dir = write_model(tmp_path / "a", profile, TritonOptions(variant="onnxruntime"), onnx)
    assert parse(ort_dir / "config.pbtxt").platform == "onnxruntime_onnx"
    assert (ort_dir / "1" / "model.onnx").read_bytes() == b"x"
    py_dir = write_model(tmp_path / "b", profile, TritonOptions(variant="python", intra_op_threads=2), onnx)
    config = parse(py_dir / "config.pbtxt")
    assert config.backend == "python"
    assert config.parameters["intra_op_threads"].string_value == "2"
    assert "class TritonPythonModel" in (py_dir / "1" / "model.py").read_text()


def test_openvino_variant_runs_the_onnx_file_on_cpu_in_bf16(tmp_path: Path) -> None:
    profile = get_profile("efficientnet-lite0")
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"x")
    model_dir = write_model(tmp_path / "a", profile, TritonOptions(variant="openvino", instances=2), onnx)
    config = parse(model_dir / "config.pbtxt")
    assert (config.backend, config.default_model_filename) == ("openvino", "model.onnx")
    assert (model_dir / "1" / "model.onnx").read_bytes() == b"x"
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    assert not config.instance_group[0].gpus
    parameters = {k: v.string_value for k, v in config.parameters.items()}
    assert parameters == {"NUM_STREAMS": "1", "PERFORMANCE_HINT": "LATENCY", "HINT_BF16": "YES"}
    fp32 = TritonOptions(variant="openvino", bf16=False, intra_op_threads=4)
    config = parse(write_model(tmp_path / "b", profile, fp32, None) / "config.pbtxt")
    assert "HINT_BF16" not in config.parameters
    assert config.parameters["INFERENCE_NUM_THREADS"].string_value == "4"


def test_committed_deploy_repositories_match_the_generator(tmp_path: Path) -> None:
    """deploy/triton is what `deploy/triton/generate.sh` writes: nobody edited it by hand."""
    committed = ROOT / "deploy" / "triton"
    gateway = [sys.executable, "-m", "service", "models", "triton-repo", "--all", "--config-only"]
    for variant, extra in (
        ("tensorrt", ["--triton-instances", "2"]),
        ("onnxruntime", ["--triton-instances", "2"]),
        ("openvino", ["--triton-instances", "2"]),
        ("python", []),
    ):
        subprocess.run(
            [*gateway, "--out", str(tmp_path / variant), "--variant", variant, *extra], check=True, capture_output=True
        )
    generated = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    kept = {
        p.relative_to(committed): p.read_bytes()
        for p in committed.rglob("*")
        if p.is_file() and p.name not in ("generate.sh", "README.md") and p.suffix not in (".onnx", ".plan")
    }
    assert kept == generated


def test_onnxruntime_on_gpu_runs_through_tensorrt_with_cached_engines(tmp_path: Path) -> None:
    """The GPU compose and Kubernetes paths serve this config: TensorRT (FP16) without a manual
    step, engines in the mounted cache, built at load for every batch size up to the maximum."""
    profile = get_profile("resnet50")
    options = TritonOptions(variant="onnxruntime", max_batch_size=32, instances=2, engine_cache="/cache/")
    config = parse(write_model(tmp_path, profile, options, onnx_path=None) / "config.pbtxt")
    (accelerator,) = config.optimization.execution_accelerators.gpu_execution_accelerator
    assert accelerator.name == "tensorrt"
    assert dict(accelerator.parameters) == {
        "precision_mode": "FP16",
        "max_workspace_size_bytes": str(4 * 1024**3),
        "trt_engine_cache_enable": "1",
        "trt_engine_cache_path": "/cache/resnet50",
    }
    assert [w.batch_size for w in config.model_warmup] == [1, 32]
    for warmup in config.model_warmup:
        (name, tensor), *_ = warmup.inputs.items()
        assert (name, tensor.data_type, list(tensor.dims), tensor.zero_data) == (
            "images",
            mc.TYPE_UINT8,
            [224, 224, 3],
            True,
        )
    for plain in (
        TritonOptions(variant="onnxruntime", kind="KIND_CPU"),
        TritonOptions(variant="onnxruntime", tensorrt_accelerator=False),
        TritonOptions(variant="openvino"),
    ):
        config = parse(write_model(tmp_path / "plain", profile, plain, onnx_path=None) / "config.pbtxt")
        assert not config.optimization.execution_accelerators.gpu_execution_accelerator
        assert not config.model_warmup


def test_the_gpu_deployments_mount_the_engine_cache() -> None:
    compose = (ROOT / "docker-compose.gpu.yml").read_text()
    assert "trt-engines:/engine-cache" in compose
    assert "--variant ${TRITON_VARIANT:-onnxruntime}" in compose
    kubernetes = (ROOT / "k8s" / "overlays" / "gpu" / "triton-gpu.yaml").read_text()
    assert "mountPath: /engine-cache" in kubernetes
    assert '"--variant", "onnxruntime"' in kubernetes
    kept = parse(ROOT / "deploy" / "triton" / "onnxruntime" / "resnet50" / "config.pbtxt")
    (accelerator,) = kept.optimization.execution_accelerators.gpu_execution_accelerator
    assert accelerator.parameters["trt_engine_cache_path"] == "/engine-cache/resnet50"
