"""``gateway models fetch|build|triton-repo|quantize|list``: the model files, built and cached."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from service.cli.common import load_settings

if TYPE_CHECKING:
    from service.settings import Settings
    from service.triton.repository import TritonOptions


def build(args: argparse.Namespace) -> int:
    from service.models.checkpoints import weights_for
    from service.models.profiles import PROFILES, get_profile
    from service.models.store import ensure_model

    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    settings = load_settings(args)
    names = list(PROFILES) if args.all else [settings.model]
    for name in names:
        path = ensure_model(settings.models_dir, get_profile(name), weights_for(settings, name), force=args.force)
        print(path)
    return 0


def triton_repo(args: argparse.Namespace) -> int:
    from service.models.checkpoints import weights_for
    from service.models.profiles import PROFILES, get_profile
    from service.models.store import ensure_model
    from service.triton.repository import TritonOptions, write_model

    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    settings = load_settings(args)
    options = TritonOptions(
        variant=args.variant,
        max_batch_size=args.triton_max_batch_size,
        preferred_batch_sizes=tuple(int(n) for n in args.triton_preferred.split(",")),
        max_queue_delay_us=args.triton_queue_delay_us,
        max_queue_size=args.triton_max_queue_size,
        instances=args.triton_instances,
        kind={"gpu": "KIND_GPU", "cpu": "KIND_CPU", None: None}[args.triton_kind],
        intra_op_threads=args.triton_intra_op_threads,
        bf16=not args.triton_no_bf16,
        tensorrt_accelerator=not args.triton_no_tensorrt,
        engine_cache=args.triton_engine_cache,
    )
    if settings.models_file is not None or settings.model_path is not None:
        return _catalog_repo(args, settings, options)
    for name in list(PROFILES) if args.all else [settings.model]:
        profile = get_profile(name)
        onnx = None
        if not args.config_only:
            onnx = ensure_model(settings.models_dir, profile, weights_for(settings, name))
        print(write_model(args.out, profile, options, onnx))
    return 0


def _catalog_repo(args: argparse.Namespace, settings: Settings, options: TritonOptions) -> int:
    """The models of a models file (or ``--model-path``'s) into the repository, declared ones as
    their derived graphs: the gateway then serves them with ``backend = "triton"``."""
    from service.models.checkpoints import weights_for
    from service.models.store import ensure_model
    from service.serving.catalog import load_catalog
    from service.triton.declared_repo import Entry, RepositoryRefused, write_catalog

    if args.all:
        print("gateway models triton-repo: --all writes the built-in profiles, not a models file's", file=sys.stderr)
        return 2

    def model_file(entry: Entry) -> Path | None:
        if args.config_only:
            return None
        if entry.profile.source is not None:
            return ensure_model(settings.models_dir, entry.profile)
        return ensure_model(settings.models_dir, entry.profile, weights_for(settings, entry.profile.name))

    try:
        written, notes = write_catalog(args.out, load_catalog(settings), options, model_file)
    except RepositoryRefused as exc:
        print(f"gateway models triton-repo: {exc}", file=sys.stderr)
        return 1
    for note in notes:
        print(f"gateway models triton-repo: {note}", file=sys.stderr)
    for folder in written:
        print(folder)
    return 0


def quantize(args: argparse.Namespace) -> int:
    from service.models.checkpoints import weights_for
    from service.models.profiles import get_profile
    from service.models.quantize import QuantizationRefused, ensure_int8
    from service.models.store import ensure_model

    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    settings = load_settings(args)
    profile = get_profile(settings.model)
    onnx = ensure_model(settings.models_dir, profile, weights_for(settings, profile.name))
    try:
        path = ensure_int8(settings.models_dir, profile, onnx, args.photos, force=args.force)
    except QuantizationRefused as exc:
        print(f"gateway models quantize: {exc}", file=sys.stderr)
        return 1
    print(path)
    print(path.with_name("build.json").read_text())
    return 0


def list_models(args: argparse.Namespace) -> int:
    from service.models.checkpoints import weights_for
    from service.models.profiles import PROFILES
    from service.models.store import model_path, recorded_sha256

    settings = load_settings(args)
    for profile in PROFILES.values():
        path = model_path(settings.models_dir, profile)
        state = (recorded_sha256(path) or "not built")[:12]
        weights = weights_for(settings, profile.name)
        source = weights.name if weights else "RANDOM weights" if profile.random_without_weights else "packaged weights"
        size = f"{profile.height}x{profile.width}px"
        print(f"{profile.name:20} v{profile.version}  {size:9}  {state:12}  {source:20}  {path}")
    return 0


def fetch(args: argparse.Namespace) -> int:
    from service.models.checkpoints import CHECKPOINTS, FetchFailed, fetch
    from service.models.profiles import get_profile
    from service.models.store import ensure_model
    from service.triton.repository import TritonOptions, write_model

    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    settings = load_settings(args)
    name = args.model or settings.model
    if name not in CHECKPOINTS:
        known = ", ".join(CHECKPOINTS)
        sys.exit(f"gateway models fetch: no published checkpoint is pinned for {name!r}; known: {known}")
    shown = [-1]

    def progress(received: int, total: int | None) -> None:
        step = received * 10 // total if total else received // (10 * 1024 * 1024)
        if step != shown[0]:
            shown[0] = step
            of = f" of {total / 1e6:.1f}" if total else ""
            print(f"  {received / 1e6:.1f}{of} MB", file=sys.stderr, flush=True)

    checkpoint = CHECKPOINTS[name]
    try:
        path = fetch(checkpoint, settings.models_dir, url=args.url, sha256=args.sha256, progress=progress)
    except FetchFailed as exc:
        sys.exit(f"gateway models fetch: {exc}")
    print(f"checkpoint: {path} ({checkpoint.description if not args.sha256 else 'SHA-256 ' + args.sha256})")
    profile = get_profile(name)
    onnx = ensure_model(settings.models_dir, profile, path)
    print(f"onnx: {onnx}")
    if args.triton_repo is not None:
        print(f"triton: {write_model(args.triton_repo, profile, TritonOptions(variant=args.variant), onnx)}")
    return 0
