"""The classification service: bytes in, labels or a vector out, through the thread pool, batcher
and backend.

What comes out depends on the model's output kind (``ModelProfile.output``): ``softmax`` and
``logits`` models answer their best labels, ranked (the backend gives probabilities for both: a
``logits`` model's graph ends in a softmax); ``sigmoid`` models every label at or above the
threshold, best first, at most ``top_k``; ``embedding`` models a vector (``embed``), and a
classification asked of one (or an embedding of a classifier) is refused with a 400 naming the
route that serves it. Shared by the HTTP API and the offline queue worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial

import numpy as np
from opentelemetry.trace import SpanContext, StatusCode

from service.batching.batcher import DynamicBatcher
from service.errors import BackendError, DeadlineExceeded, GatewayError
from service.images.budget import Budget
from service.images.imageinfo import probe
from service.images.preprocess import PreprocessConfig, check_limits, prepare
from service.metrics import Metrics
from service.models.profiles import ModelProfile, rank_rows, top_k
from service.schemas import ModelInfo
from service.tracing import Tracing, sampled_context, trace_id_hex


@dataclass(frozen=True)
class ImageInput:
    data: bytes
    filename: str | None = None
    content_type: str | None = None


def _check(images: list[ImageInput], config: PreprocessConfig) -> None:
    for i, image in enumerate(images):
        try:
            check_limits(probe(image.data), config)
        except GatewayError as exc:
            raise _naming_the_image(exc, i, images) from None


async def validate(images: list[ImageInput], config: PreprocessConfig, executor: Executor) -> None:
    """The cheap checks only (format, header, decoded size), for work queued to be decoded later:
    nothing of a model is needed, so a model not loaded here is not loaded for them.

    In the thread pool, like decoding: even a bounded header walk is CPU the event loop must not
    spend."""
    await asyncio.get_running_loop().run_in_executor(executor, _check, images, config)


def _naming_the_image(exc: BaseException, index: int, images: list[ImageInput]) -> BaseException:
    """In a request of several images, say which one failed (a lone image needs no name)."""
    if isinstance(exc, GatewayError) and len(images) > 1:
        name = f" ({images[index].filename})" if images[index].filename else ""
        exc.detail = f"image {index + 1} of {len(images)}{name}: {exc.detail}"
    return exc


class UnexpectedOutput(BackendError):
    """The model gave rows of another width than the one checked at start (a width dynamic in its
    file): refused as the backend's failure, never an IndexError from the labels."""

    status_code = 502


def check_width(profile: ModelProfile, rows: Sequence[np.ndarray], model: str, version: str) -> None:
    """Every row is ``profile.outputs`` numbers long, or ``UnexpectedOutput`` naming both widths."""
    for row in rows:
        if row.shape != (profile.outputs,):
            what = f"its {len(profile.labels)} labels" if profile.classifies else "its embedding's length"
            raise UnexpectedOutput(
                f"model {model!r} version {version} gave {row.size} numbers for an image; it was checked at "
                f"start for {profile.outputs} ({what}): its output's width is dynamic in its file and the "
                "declaration does not match what it gives"
            )


class NotAClassifier(GatewayError):
    """Labels asked of a model whose output is an embedding: its ``/embed`` route serves it."""

    status_code = 400
    error = "not_a_classifier"


class NotAnEmbeddingModel(GatewayError):
    """An embedding asked of a model whose output is labels: its ``/classify`` route serves it."""

    status_code = 400
    error = "not_an_embedding_model"


def require_labels(profile: ModelProfile, model: str, version: str) -> None:
    """Refuse (400) a classification of a model that gives embeddings, naming the route that serves it."""
    if not profile.classifies:
        raise NotAClassifier(
            f"model {model!r} version {version} gives embeddings ({profile.outputs} numbers per image), not "
            f"labels: POST /v1/models/{model}/embed"
        )


def require_embedding(profile: ModelProfile, model: str, version: str) -> None:
    """Refuse (400) an embedding of a model that gives labels, naming the route that serves it."""
    if profile.output != "embedding":
        raise NotAnEmbeddingModel(
            f"model {model!r} version {version} gives labels ({profile.output}), not embeddings: "
            f"POST /v1/models/{model}/classify"
        )


@dataclass(frozen=True)
class Classification:
    filename: str | None
    labels: list[tuple[int, str, float]]


Prepare = Callable[[bytes, PreprocessConfig, Budget | None, float | None], np.ndarray]
"""Encoded bytes to the model's input: ``preprocess.prepare`` and its GPU twin."""
PrepareMany = Callable[[list[bytes], PreprocessConfig, Budget | None, float | None], list["np.ndarray | Exception"]]
"""A request's images decoded together (the GPU decoder's ``prepare_many``): each entry the image's
array or its error."""
RANKED = 20
"""Classes the batcher ranks per image, once per batch: the most a request may ask for (top_k)."""


@dataclass(frozen=True, slots=True)
class Scored:
    """One image's answer from the batcher: its best classes, ranked with its batch's, and its
    whole score row (a view of the batch's scores, for protocols that return every class)."""

    ranked: list[tuple[int, float]]
    """The ``RANKED`` best (class index, probability), best first."""
    scores: np.ndarray


def rank_batch(scores: np.ndarray) -> list[Scored]:
    """The batcher's ``rank``: every row's best classes at once (``rank_rows``), and the row."""
    return [Scored(ranked, scores[i]) for i, ranked in enumerate(rank_rows(scores, RANKED))]


def rows_of(scores: np.ndarray) -> list[np.ndarray]:
    """The batcher's ``rank`` for an embedding model: every row as it is (a view of the batch's
    scores; the backends return arrays of their own), nothing ranked."""
    return list(scores)


def rank_for(profile: ModelProfile) -> Callable[[np.ndarray], Sequence[Scored | np.ndarray]]:
    """What the batcher makes of a batch's scores for this model, once per batch: ranked classes
    for a classifier, the rows alone for an embedding model."""
    return rank_batch if profile.classifies else rows_of


def _best(row: Scored | np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k best classes of a row the batcher ranked already, or of a score row."""
    if isinstance(row, Scored):
        return row.ranked[:k] if k <= len(row.ranked) else top_k(row.scores, k)
    return top_k(row, k)


def _scores(row: Scored | np.ndarray) -> np.ndarray:
    return row.scores if isinstance(row, Scored) else row


class Classifier:
    def __init__(
        self,
        profile: ModelProfile,
        batcher: DynamicBatcher,
        executor: Executor,
        metrics: Metrics,
        config: PreprocessConfig,
        budget: Budget | None = None,
        tracing: Tracing | None = None,
        random_weights: bool = False,
        decode: Prepare = prepare,
        decode_many: PrepareMany | None = None,
        name: str | None = None,
        version: str | None = None,
    ) -> None:
        """``name`` and ``version``: what the model is served as (default: its profile's)."""
        self.profile = profile
        self.batcher = batcher
        self.executor = executor
        self.metrics = metrics
        self.config = config
        self.budget = budget
        """Decoder memory shared by the pool's threads (None: each thread bounded by the config alone)."""
        self.tracing = tracing
        self._decode = decode
        """``preprocess.prepare`` (OpenCV), or the GPU decoder's (``service.images.gpu_decode``)."""
        self._decode_many = decode_many
        """Where set, a request's several images are decoded by one call instead of one pool task each."""
        self.model_info = ModelInfo(
            name=name or profile.name, version=version or profile.version, random_weights=random_weights
        )
        self._threshold = float(np.float32(profile.threshold)) if profile.output == "sigmoid" else None
        """``sigmoid``: the threshold at the scores' own precision (float32), so a score equal to
        the threshold as written is at it, not below."""

    def _prepare_timed(self, data: bytes, deadline: float | None, parent: SpanContext | None = None) -> np.ndarray:
        """Decode one image (in a pool thread), timed; under ``parent`` (a sampled request's span)
        as a ``decode`` span whose trace id the duration's exemplar carries."""
        span = None
        if parent is not None and self.tracing is not None:
            span = self.tracing.child("decode", parent, attributes={"gateway.image.bytes": len(data)})
        start = time.perf_counter()
        try:
            return self._decode(data, self.config, self.budget, deadline)
        except Exception as exc:
            if span is not None:
                span.set_status(StatusCode.ERROR, str(exc))
                span.set_attribute("error.type", getattr(exc, "error", type(exc).__name__))
            raise
        finally:
            seconds = time.perf_counter() - start
            if span is None:
                self.metrics.preprocess_duration.observe(seconds)
            else:
                self.metrics.preprocess_duration.observe(seconds, {"trace_id": trace_id_hex(span.get_span_context())})
                span.end()

    def _prepare_many_timed(self, images: list[ImageInput], deadline: float | None) -> list[np.ndarray | Exception]:
        """A request's images decoded by one ``decode_many`` call; each image's decode time is the
        call's share (the duration histogram counts images)."""
        assert self._decode_many is not None
        start = time.perf_counter()
        try:
            return self._decode_many([image.data for image in images], self.config, self.budget, deadline)
        finally:
            share = (time.perf_counter() - start) / len(images)
            for _ in images:
                self.metrics.preprocess_duration.observe(share)

    async def preprocess(
        self, images: list[ImageInput], deadline: float | None = None, parent: SpanContext | None = None
    ) -> list[np.ndarray]:
        """Decode every image in the pool; if any is bad, raise its error naming which image.

        A request whose images are not all valid is refused whole, before anything is queued."""
        loop = asyncio.get_running_loop()
        outcomes: list[np.ndarray | BaseException]
        if self._decode_many is not None and len(images) > 1:
            outcomes = list(await loop.run_in_executor(self.executor, self._prepare_many_timed, images, deadline))
        else:
            outcomes = await asyncio.gather(
                *(
                    loop.run_in_executor(self.executor, self._prepare_timed, image.data, deadline, parent)
                    for image in images
                ),
                return_exceptions=True,
            )
        arrays: list[np.ndarray] = []
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, BaseException):
                raise _naming_the_image(outcome, i, images)
            arrays.append(outcome)
        return arrays

    async def validate(self, images: list[ImageInput]) -> None:
        """The cheap checks only (``validate``)."""
        await validate(images, self.config, self.executor)

    async def _rows(self, images: list[ImageInput], deadline: float | None) -> list[Scored | np.ndarray]:
        """Every image decoded, batched and scored: its row from the batcher."""
        parent = sampled_context() if self.tracing is not None else None
        if len(images) == 1:  # the common case, decoded and queued from the pool in one step
            prepare = partial(self._prepare_timed, images[0].data, deadline, parent)
            return [await self.batcher.submit_prepared(prepare, self.executor, deadline=deadline, parent=parent)]
        try:  # all decoded before any is queued: a bad image refuses its request whole
            async with asyncio.timeout_at(deadline):
                arrays = await self.preprocess(images, deadline, parent)
        except TimeoutError:
            raise DeadlineExceeded("the request deadline passed while decoding its images") from None
        return list(await self.batcher.submit(arrays, deadline=deadline, parent=parent))

    async def scores(self, images: list[ImageInput], *, deadline: float | None) -> list[np.ndarray]:
        """Every image's probabilities over all classes, through the same decode, batcher and
        backend as ``classify``."""
        return [_scores(row) for row in await self._rows(images, deadline)]

    async def classify(
        self, images: list[ImageInput], *, k: int, deadline: float | None, thresholded: bool = True
    ) -> list[Classification]:
        """Each image's ``k`` best labels, best first (``sigmoid``: of those, the ones at or above
        the threshold, unless not ``thresholded``). 400 for a model that gives embeddings, before
        anything is decoded."""
        info = self.model_info
        require_labels(self.profile, info.name, info.version)
        rows = await self._rows(images, deadline)
        check_width(self.profile, [_scores(row) for row in rows], info.name, info.version)
        started = time.perf_counter()
        labels = self.profile.labels
        threshold = self._threshold if thresholded else None
        out = []
        for image, row in zip(images, rows, strict=True):
            best = _best(row, k)
            if threshold is not None:  # best first: the labels at or above the threshold lead
                best = [(i, score) for i, score in best if score >= threshold]
            out.append(Classification(image.filename, [(i, labels[i], score) for i, score in best]))
        self.metrics.postprocess_duration.observe(time.perf_counter() - started)
        return out

    async def embed(self, images: list[ImageInput], *, deadline: float | None) -> list[np.ndarray]:
        """Each image's vector (float32, ``profile.outputs`` long), through the same decode, batcher
        and backend as ``classify``. 400 for a model that gives labels, before anything is decoded."""
        info = self.model_info
        require_embedding(self.profile, info.name, info.version)
        vectors = [_scores(row) for row in await self._rows(images, deadline)]
        check_width(self.profile, vectors, info.name, info.version)
        return vectors
