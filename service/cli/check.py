"""``gateway models check PATH [--labels ...] [--photo P ...]``: try a model of your own before
serving it. Prints what was read from the file, what the declaration adds (and what is a default),
what the gateway will send it, and, for each photo given, its answer through the same preprocessing,
derived graph and backend the gateway serves it with.

The declaration is checked exactly as ``gateway serve --model-path PATH`` checks it (the same
settings, the same errors); a problem ends the command with status 1 and the message."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
from pathlib import Path

import numpy as np

from service.cli.common import load_settings
from service.errors import GatewayError
from service.models.declaration import Declaration, parse_declaration
from service.models.profiles import ModelProfile
from service.serving.catalog import load_catalog
from service.settings import Settings
from service.settings.values import read_regular_bytes

SHOWN_LABELS = 5


def check(args: argparse.Namespace) -> int:
    from service.models.facts import read_facts

    settings = load_settings(args)  # the declaration and the file, checked as serve checks them
    spec = load_catalog(settings).models[0]
    version = spec.versions[0]
    profile = version.profile
    source = profile.source
    assert source is not None  # a --model-path catalog declares its model
    declared = parse_declaration(settings.declared(), "", base=Path.cwd(), root=settings.models_root)
    facts = read_facts(source.path)
    size = source.path.stat().st_size
    with source.path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    print(
        f"model {spec.name!r} version {version.version}: {source.path} ({facts.format}, {size / 1e6:.1f} MB, ", end=""
    )
    print(f"sha256 {digest[:16]}...)")
    print("read from the file:")
    for tensor in facts.inputs:
        print(f"  input  {tensor}")
    for tensor in facts.outputs:
        print(f"  output {tensor}")
    print("the declaration (declared, from the file, or the default):")
    for key, value, given in _keys(profile, declared):
        print(f"  {key:13} {value:40} {given}")
    print(f"the gateway sends: 'images' [N, {profile.height}, {profile.width}, 3] uint8 RGB; ", end="")
    print(f"the model's runtime does the arithmetic, and reads {profile.outputs} numbers per image")
    if args.photo:
        return asyncio.run(_run_photos(settings, profile, args.photo, args.top_k))
    return 0


def _keys(profile: ModelProfile, d: Declaration) -> list[tuple[str, str, str]]:
    assert profile.source is not None
    arithmetic = profile.source.arithmetic
    rows: list[tuple[str, str, object, str]] = [
        ("input_size", f"{profile.height} x {profile.width}", d.input_size, "from the file"),
        ("resize", profile.resize, d.resize, "default"),
        ("crop_fraction", f"{profile.crop_fraction:g}", d.crop_fraction, "default"),
        ("color", arithmetic.color, d.color, "default"),
        ("layout", arithmetic.layout, d.layout, "from the file"),
        ("input_dtype", arithmetic.dtype, d.input_dtype, "from the file"),
        ("scale", f"{arithmetic.scale:g}", d.scale, "default"),
        ("mean", _numbers(arithmetic.mean), d.mean, "default"),
        ("std", _numbers(arithmetic.std), d.std, "default"),
        ("output", profile.output, d.output, "default"),
    ]
    if profile.output == "sigmoid":
        rows.append(("threshold", f"{profile.threshold:g}", d.threshold, "default"))
    if profile.classifies:
        labels = profile.labels
        shown = ", ".join(labels[:SHOWN_LABELS]) + (", ..." if len(labels) > SHOWN_LABELS else "")
        rows.append(("labels", f"{len(labels)}: {shown}"[:60], d.labels, "declared"))
    else:
        rows.append(("dimensions", str(profile.outputs), None, "from the file"))
    if profile.resize != "crop":
        rows = [row for row in rows if row[0] != "crop_fraction"]
    return [(key, value, "declared" if given is not None else otherwise) for key, value, given, otherwise in rows]


def _numbers(values: tuple[float, ...]) -> str:
    return "[" + ", ".join(f"{v:g}" for v in values) + "]"


async def _run_photos(settings: Settings, profile: ModelProfile, photos: list[Path], k: int) -> int:
    """Each photo through the gateway's preprocessing, the derived graph and the configured backend."""
    from service.backends.factory import build_backend
    from service.images.preprocess import PreprocessConfig, prepare

    config = PreprocessConfig(profile.height, profile.width, profile.resize, profile.crop_fraction)
    backend = await build_backend(settings, profile)
    await backend.start()
    try:
        if (problem := await backend.ready()) is not None:
            print(f"gateway models check: the {backend.name} backend cannot run it: {problem}", file=sys.stderr)
            return 1
        failed = 0
        for photo in photos:
            try:  # bounded as a request's body is: a FIFO, a device or a huge file is refused, not read
                image = prepare(read_regular_bytes(photo, settings.max_body_bytes, "photo"), config)
            except (ValueError, GatewayError) as exc:  # unreadable, or not an image the gateway takes
                print(f"{photo}: {str(exc).removeprefix('photo: ')}")
                failed += 1
                continue
            row = (await backend.infer(np.asarray(image)[None]))[0]
            if row.shape != (profile.outputs,):
                print(f"{photo}: {_width_problem(profile, row)}")
                failed += 1
                continue
            print(f"{photo}: {_answer(profile, row, k)}")
            if (doubt := _doubt(profile, row)) is not None:
                print(f"  note: {doubt}")
        return 1 if failed else 0
    finally:
        await backend.aclose()


def _width_problem(profile: ModelProfile, row: np.ndarray) -> str:
    what = f"{len(profile.labels)} labels" if profile.classifies else "an embedding of that length"
    return (
        f"the model gave {row.size} numbers for this image; it was checked for {profile.outputs} ({what}): its "
        "output's width is dynamic in the file, declare labels (or re-export the model) to match what it gives"
    )


def _doubt(profile: ModelProfile, row: np.ndarray) -> str | None:
    """A sign that the declaration is wrong: scores that are not finite (the arithmetic, or the
    model, overflows), or "softmax" scores that are not probabilities."""
    if not np.all(np.isfinite(row)):
        bad = int(np.count_nonzero(~np.isfinite(row)))
        return (
            f"{bad} of the {row.size} scores are not finite (inf or NaN): check scale, mean and std, and "
            "input_dtype (a float16 model overflows past 65504)"
        )
    if profile.output != "softmax":
        return None
    total, low, high = float(row.sum()), float(row.min()), float(row.max())
    if low >= -1e-4 and high <= 1 + 1e-4 and abs(total - 1) <= 1e-2:
        return None
    return (
        f'output = "softmax" says the model gives probabilities, but these scores run from {low:.3g} to '
        f'{high:.3g} and sum to {total:.3g}: if the model ends in logits, declare output = "logits" '
        '(--output logits), or "sigmoid" for independent labels'
    )


def _answer(profile: ModelProfile, row: np.ndarray, k: int) -> str:
    if not profile.classifies:
        head = ", ".join(f"{v:.4f}" for v in row[:4])
        return f"embedding of {row.shape[0]} ({head}, ...), norm {float(np.linalg.norm(row)):.4f}"
    order = np.argsort(-row, kind="stable")[:k]
    if profile.output == "sigmoid":
        order = np.asarray([i for i in order if row[i] >= profile.threshold], dtype=np.int64)
        if not order.size:
            best = profile.labels[int(np.argmax(row))]
            return f"no label at or above the threshold ({profile.threshold:g}); the best: {best}"
    return ", ".join(f"{profile.labels[i]} {row[i]:.3f}" for i in order.tolist())
