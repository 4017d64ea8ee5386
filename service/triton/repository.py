"""Write Triton model repositories for the gateway's models.

Three variants take the same input (``images``, UINT8 ``[N, 224, 224, 3]``, RGB) and give the same
output (``scores``, FP32 ``[N, 1000]``, softmax), with normalisation inside the model:

* ``tensorrt``: a ``tensorrt_plan`` model for NVIDIA GPUs. The plan is built on the target GPU from
  the ONNX file by the generated ``build_plan.sh`` (``trtexec``, FP16, dynamic batch).
* ``onnxruntime``: the ONNX file on Triton's ONNX Runtime backend (GPU or CPU). On GPU instances
  its TensorRT execution accelerator is on by default (FP16; what TensorRT cannot run falls back to
  CUDA), with the engines cached in ``engine_cache`` (a volume: a restart loads them instead of
  building them again, which takes minutes) and built at load by a warm-up at batch 1 and at
  ``max_batch_size``, so that no batch size met while serving triggers a rebuild. Nothing to build
  by hand, unlike ``tensorrt``.
* ``openvino``: the ONNX file on Triton's OpenVINO backend, for CPU hosts (the model converted for
  the CPU at load; bfloat16 kernels where the CPU has them, ``HINT_BF16``). One stream per instance:
  instances give the parallelism, as with the other variants.
* ``python``: the ONNX file run by ONNX Runtime inside Triton's Python backend, for CPU hosts and for
  the ``tritonserver`` binary that PyPI's pytriton wheel ships (which has only that backend).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from service.models.profiles import ModelProfile
from service.models.tensors import INPUT_NAME, OUTPUT_NAME

Variant = Literal["tensorrt", "onnxruntime", "openvino", "python"]
VARIANTS: tuple[Variant, ...] = ("tensorrt", "onnxruntime", "openvino", "python")
CPU_VARIANTS = ("openvino", "python")
PYTHON_MODEL = Path(__file__).with_name("python_model.py")


@dataclass(frozen=True)
class TritonOptions:
    variant: Variant = "python"
    max_batch_size: int = 64
    """Largest batch Triton accepts and forms; the gateway's batches must not exceed it."""
    preferred_batch_sizes: tuple[int, ...] = (8, 16, 32)
    max_queue_delay_us: int = 2000
    """How long Triton's dynamic batcher waits for a preferred size."""
    max_queue_size: int = 0
    """Requests queued per model before Triton answers "exceeds maximum queue size" (gateway: 429);
    0 leaves Triton's queue unbounded and the bound to the gateway's own queue. Off by default: with
    any ``default_queue_policy`` Triton 2.51 held requests in its queue ~500 ms at low load (trivial
    model, batch 1, one client: 10.8 req/s and p99 502 ms with the policy, 298 req/s and p99 5.5 ms
    without; see deploy/triton/README.md)."""
    instances: int = 1
    """Model instances (per GPU for GPU variants): the study (docs/study.md) runs several per GPU."""
    kind: Literal["KIND_GPU", "KIND_CPU"] | None = None
    """Default: GPU for tensorrt and onnxruntime, CPU for openvino and python."""
    intra_op_threads: int = 0
    """Runtime threads per execution (python variant: ONNX Runtime's; openvino: OpenVINO's; 0: its default)."""
    bf16: bool = True
    """openvino variant: ask for bfloat16 kernels (used where the CPU has them)."""
    extra_parameters: dict[str, str] = field(default_factory=dict)
    tensorrt_accelerator: bool = True
    """onnxruntime variant on GPU instances: run the model through the TensorRT execution accelerator."""
    engine_cache: str = "/engine-cache"
    """Where the TensorRT accelerator keeps its engines (mount a volume there), one folder per model."""
    trt_workspace_bytes: int = 4 * 1024**3
    """GPU memory TensorRT may use while building and running an engine."""

    @property
    def instance_kind(self) -> str:
        return self.kind or ("KIND_CPU" if self.variant in CPU_VARIANTS else "KIND_GPU")


LABELS_FILE = "labels.txt"
"""A declared classifier's labels beside its config (``label_filename``: Triton's classification
extension answers ``score:index:label``)."""


def render_config(
    name: str, profile: ModelProfile, options: TritonOptions, versions: Sequence[str] | None = None
) -> str:
    """``versions``: the versions Triton serves (None: the latest one)."""
    height, width = profile.input_size
    classes = profile.outputs
    header = {
        "tensorrt": 'platform: "tensorrt_plan"\ndefault_model_filename: "model.plan"',
        "onnxruntime": 'platform: "onnxruntime_onnx"\ndefault_model_filename: "model.onnx"',
        "openvino": 'backend: "openvino"\ndefault_model_filename: "model.onnx"',
        "python": 'backend: "python"',
    }[options.variant]
    preferred = ", ".join(str(n) for n in options.preferred_batch_sizes if n <= options.max_batch_size)
    preferred_line = f"  preferred_batch_size: [ {preferred} ]\n" if preferred else ""
    parameters = dict(options.extra_parameters)
    if options.variant == "python":
        parameters.setdefault("intra_op_threads", str(options.intra_op_threads))
    if options.variant == "openvino":
        parameters.setdefault("NUM_STREAMS", "1")
        parameters.setdefault("PERFORMANCE_HINT", "LATENCY")
        if options.intra_op_threads:
            parameters.setdefault("INFERENCE_NUM_THREADS", str(options.intra_op_threads))
        if options.bf16:
            parameters.setdefault("HINT_BF16", "YES")
    params = "".join(
        f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in sorted(parameters.items())
    )
    gpus = "\n    gpus: [ 0 ]" if options.instance_kind == "KIND_GPU" else ""
    origin = f"`gateway models triton-repo --variant {options.variant}`; {profile.name} v{profile.version}"
    labels = ""
    if profile.source is not None:
        origin = f"`gateway models triton-repo --variant {options.variant}`; declared model {profile.name}"
        if profile.source.file is not None:
            origin += f" from {profile.source.file.name}"
        if profile.classifies:
            labels = f'\n    label_filename: "{LABELS_FILE}"'
    policy = "latest: { num_versions: 1 }"
    if versions is not None and len(versions) > 1:
        policy = f"specific: {{ versions: [ {', '.join(sorted(versions, key=int))} ] }}"
    queue_policy = (
        f"\n  default_queue_policy {{ max_queue_size: {options.max_queue_size} }}" if options.max_queue_size else ""
    )
    accelerator = _tensorrt_accelerator(name, profile, options)
    return f"""# Generated by {origin}.
name: "{name}"
{header}
max_batch_size: {options.max_batch_size}
input [
  {{
    name: "{INPUT_NAME}"
    data_type: TYPE_UINT8
    format: FORMAT_NHWC
    dims: [ {height}, {width}, 3 ]
  }}
]
output [
  {{
    name: "{OUTPUT_NAME}"
    data_type: TYPE_FP32
    dims: [ {classes} ]{labels}
  }}
]
dynamic_batching {{
{preferred_line}  max_queue_delay_microseconds: {options.max_queue_delay_us}{queue_policy}
}}
instance_group [
  {{
    count: {options.instances}
    kind: {options.instance_kind}{gpus}
  }}
]
version_policy: {{ {policy} }}
{accelerator}{params}"""


def _tensorrt_accelerator(name: str, profile: ModelProfile, options: TritonOptions) -> str:
    """The ONNX Runtime backend's TensorRT accelerator (FP16, engine cache) and the warm-up that
    builds its engines at load: TensorRT builds one per range of input shapes it has met, so batch 1
    and ``max_batch_size`` at load cover every batch served later."""
    if not (options.variant == "onnxruntime" and options.instance_kind == "KIND_GPU" and options.tensorrt_accelerator):
        return ""
    height, width = profile.input_size
    trt = {
        "precision_mode": "FP16",
        "max_workspace_size_bytes": str(options.trt_workspace_bytes),
        "trt_engine_cache_enable": "1",
        "trt_engine_cache_path": f"{options.engine_cache.rstrip('/')}/{name}",
    }
    parameters = "".join(f'\n      parameters {{ key: "{k}" value: "{v}" }}' for k, v in trt.items())
    warmups = "".join(
        f"""
  {{
    name: "batch {batch}"
    batch_size: {batch}
    inputs {{ key: "{INPUT_NAME}" value: {{ data_type: TYPE_UINT8 dims: [ {height}, {width}, 3 ] zero_data: true }} }}
  }},"""
        for batch in sorted({1, options.max_batch_size})
    ).rstrip(",")
    return f"""optimization {{ execution_accelerators {{
  gpu_execution_accelerator: [
    {{
      name: "tensorrt"{parameters}
    }}
  ]
}} }}
model_warmup [{warmups}
]
"""


def render_build_script(profile: ModelProfile, options: TritonOptions, version: str | None = None) -> str:
    height, width = profile.input_size
    version = version or profile.version
    opt = max((n for n in options.preferred_batch_sizes if n <= options.max_batch_size), default=1)
    return f"""#!/usr/bin/env sh
# Build {version}/model.plan from model.onnx with TensorRT, on the GPU that will serve it
# (a plan is specific to the GPU model and the TensorRT version). Run it inside NVIDIA's
# tritonserver or tensorrt container of the same release as the Triton that serves the plan:
#   docker run --rm --gpus all -v "$PWD":/m -w /m nvcr.io/nvidia/tensorrt:<release>-py3 sh build_plan.sh
# Input: UINT8 NHWC {height}x{width}x3, dynamic batch 1..{options.max_batch_size}, optimised for {opt}; FP16 kernels.
set -eu
cd "$(dirname "$0")"
mkdir -p {version}
trtexec \\
  --onnx=model.onnx \\
  --saveEngine={version}/model.plan \\
  --fp16 \\
  --minShapes={INPUT_NAME}:1x{height}x{width}x3 \\
  --optShapes={INPUT_NAME}:{opt}x{height}x{width}x3 \\
  --maxShapes={INPUT_NAME}:{options.max_batch_size}x{height}x{width}x3 \\
  --memPoolSize=workspace:4096 \\
  --skipInference
echo "wrote $(pwd)/{version}/model.plan"
"""


def _place(source: Path, target: Path) -> None:
    """Hard-link when possible (the ONNX file can be 100 MB), else copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _inside(folder: Path, name: str) -> Path:
    """``folder / name``, a folder directly in ``folder`` (a model's or a version's): a name that
    leaves it (``..``, an absolute path, a separator, a symlink out of it) is refused, never
    written elsewhere."""
    inside = folder / name
    if (
        not name
        or name in (".", "..")
        or any(c in name for c in "/\\\0")
        or not inside.resolve().is_relative_to(folder.resolve())
    ):
        raise ValueError(f"{name[:64]!r} is not a folder in the Triton repository {folder}")
    return inside


def write_model(
    repository: Path,
    profile: ModelProfile,
    options: TritonOptions,
    onnx_path: Path | None,
    name: str | None = None,
    *,
    version: str | None = None,
    versions: Sequence[str] | None = None,
) -> Path:
    """Write one model directory into ``repository`` and return it. With ``onnx_path`` None only the
    configuration files are written (what the repository under deploy/ keeps in git).

    ``version``: its version folder (default: the profile's); ``versions``: every version the
    config serves (default: the latest). A declared classifier's labels are written beside its
    config (``labels.txt``)."""
    name = name or profile.name
    model_dir = _inside(repository, name)
    version_dir = _inside(model_dir, version or profile.version)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(render_config(name, profile, options, versions))
    if profile.source is not None and profile.classifies:
        (model_dir / LABELS_FILE).write_text("".join(f"{label}\n" for label in profile.labels))
    if options.variant == "tensorrt":
        script = model_dir / "build_plan.sh"
        script.write_text(render_build_script(profile, options, version))
        script.chmod(0o755)
        if onnx_path is not None:
            _place(onnx_path, model_dir / "model.onnx")
    else:
        if onnx_path is not None:
            _place(onnx_path, version_dir / "model.onnx")
        if options.variant == "python":
            version_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(PYTHON_MODEL, version_dir / "model.py")
    return model_dir
