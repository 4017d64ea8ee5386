"""Bodies of the HTTP API (they make the OpenAPI schema)."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_URL_LENGTH = 2048
"""Longest image URL accepted in a JSON body, in characters."""


class UrlImage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(
        min_length=1,
        max_length=MAX_URL_LENGTH,
        description="An https URL of the image (http only where GATEWAY_URL_ALLOW_HTTP is set). The "
        "gateway fetches it; private, loopback, link-local and metadata addresses are refused unless "
        "allow-listed.",
    )


class UrlImages(BaseModel):
    """The JSON request body of POST /classify: images by URL."""

    model_config = ConfigDict(extra="forbid")
    images: list[UrlImage] = Field(min_length=1, description="One entry per image, answered in this order.")


class Label(BaseModel):
    index: int = Field(description="Class index, in the model's label order (ImageNet-1k: 0-999).")
    label: str = Field(description="Human-readable class name.")
    score: float = Field(
        description="Probability, 0-1: over all the classes (softmax, logits), or the label's own (sigmoid)."
    )


class ImageResult(BaseModel):
    filename: str | None = Field(description="The multipart part's filename, when it had one, or the image's URL.")
    labels: list[Label] = Field(
        description="The top_k classes, best first (a sigmoid model: those at or above its threshold, at most top_k)."
    )


class ModelInfo(BaseModel):
    name: str
    version: str
    random_weights: bool = Field(
        default=False,
        description="True when the model runs with random weights (no checkpoint was given or fetched): its "
        "labels are meaningless. `gateway models fetch <model>` or GATEWAY_MODEL_WEIGHTS gives it real ones.",
    )


class ClassifyResponse(BaseModel):
    model: ModelInfo
    results: list[ImageResult] = Field(description="One entry per image, in the order sent.")


class ImageEmbedding(BaseModel):
    filename: str | None = Field(description="The multipart part's filename, when it had one, or the image's URL.")
    vector: list[float] = Field(description="The model's output for the image (float32 values).")
    dimensions: int = Field(description="Numbers in the vector.")


class EmbedResponse(BaseModel):
    """The answer of POST /v1/models/{name}/embed (JSON)."""

    model: ModelInfo
    embeddings: list[ImageEmbedding] = Field(description="One entry per image, in the order sent.")


class ErrorBody(BaseModel):
    error: str = Field(description="Machine-readable error code, e.g. bad_image, queue_full.")
    detail: str = Field(description="What was wrong, for a person.")
    request_id: str | None = Field(
        default=None,
        description="The request's id, as in the X-Request-ID header and the gateway's log lines "
        "(absent in a job's stored error).",
    )


class Readiness(BaseModel):
    ready: bool
    checks: dict[str, str] = Field(description="Each dependency and 'ok' or why it is not ready.")


class AcceptedJob(BaseModel):
    job_id: str
    filename: str | None
    status_url: str = Field(description="Where to ask for the result: GET /jobs/{job_id}.")


class JobsAccepted(BaseModel):
    jobs: list[AcceptedJob] = Field(description="One job per image, in the order sent.")


class JobStatus(BaseModel):
    job_id: str
    status: str = Field(description="pending, done or failed.")
    filename: str | None = None
    waiting: str | None = Field(
        default=None,
        description="While pending: why the job is not classified yet, when a worker said so "
        "(e.g. \"no worker serves model 'x': requeued for one that does ...\"); null otherwise.",
    )
    labels: list[Label] = Field(default_factory=list)
    embedding: list[float] | None = Field(
        default=None, description="When done, by a model that gives embeddings: the image's vector (else null)."
    )
    error: ErrorBody | None = None
    model: ModelInfo | None = None
    timings: dict[str, float] = Field(default_factory=dict)


class Batching(BaseModel):
    max_batch_size: int
    max_delay: float = Field(description="Seconds a batch waits to fill while another is in the backend.")
    policy: str = Field(description="fixed or adaptive.")
    max_inflight_batches: int
    max_queue_size: int


class VersionState(StrEnum):
    """Where a model version stands; why, when it is not ``ready``, is said beside it (``reason``)."""

    LOADING = "loading"
    """Its model is loading (on first use, under GATEWAY_MODEL_MEMORY_BUDGET); requests wait for it."""
    READY = "ready"
    """Its backend answered the latest readiness check."""
    UNAVAILABLE = "unavailable"
    """Started, but its backend cannot serve now (Triton unreachable or without the model, the circuit
    open, the shared engine gone); served again once it can, without a restart."""
    UNLOADED = "unloaded"
    """Not in memory (under GATEWAY_MODEL_MEMORY_BUDGET): it loads on its next request."""
    FAILED = "failed"
    """Its last load failed: refused at once until a load is tried again."""


class ModelVersionState(BaseModel):
    version: str
    profile: str = Field(
        description="The graph it runs: efficientnet-lite0, resnet50, trivial, or the model's own for a declared model."
    )
    backend: str
    traffic: float = Field(description="Share of the model's unversioned requests this version takes (0-1).")
    ready: bool = Field(description="It takes requests: ready, or loading or unloaded (a request waits for the load).")
    loaded: bool = Field(
        description="Its model is in memory where it runs: in this process, or in Triton or the shared engine "
        "as far as their latest readiness check says (false while they are unreachable)."
    )
    state: VersionState = Field(
        description="loading, ready, unavailable (started, its backend cannot serve now), unloaded (loads on "
        "first use) or failed (its last load failed)."
    )
    reason: str | None = Field(
        description="Why it is unavailable or failed; when it is retried, for a failed load. Null otherwise."
    )


class ModelSummary(BaseModel):
    name: str
    default: bool = Field(description="True for the model POST /classify serves.")
    ready: bool = Field(description="At least one version taking traffic is ready.")
    share: float = Field(description="Weight in the fair sharing of admission and decoding between models.")
    sticky: bool = Field(description="Each API key always gets the same version (while the weights stay).")
    versions: list[ModelVersionState]


class ModelsList(BaseModel):
    models: list[ModelSummary]


class VersionMetadata(ModelVersionState):
    image_size: int = Field(
        description="Deprecated: input_size's height (the side of the input when it was always square).",
        deprecated=True,
    )
    input_size: list[int] = Field(description="Height and width of the RGB input the images are made into.")
    resize: Literal["crop", "stretch", "letterbox"] = Field(
        description="How a photo becomes the input: crop (scale to cover, keep the centre), stretch (each side "
        "to fit) or letterbox (fit inside, pad with grey)."
    )
    crop_fraction: float = Field(description="Share of the shorter side kept by the centre crop.")
    output: Literal["softmax", "logits", "sigmoid", "embedding"] = Field(
        description="What the model gives: ranked labels (softmax, logits), every label at or above the "
        "threshold (sigmoid), or a vector (embedding, served by POST /v1/models/{name}/embed)."
    )
    threshold: float | None = Field(description="sigmoid: the score at or above which a label is answered; else null.")
    dimensions: int = Field(description="Numbers per image in the model's output: its labels, or its vector's length.")
    precision: str
    random_weights: bool
    batching: Batching
    labels: list[str] | None = Field(description="Class names, by class index (null for an embedding model).")


class ModelMetadata(BaseModel):
    name: str
    default: bool
    ready: bool
    share: float
    sticky: bool
    versions: list[VersionMetadata]
