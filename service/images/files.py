"""The one table of the image types the gateway takes: each format (as the header probe names it),
its media type, and the file suffixes that mark it in a folder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ImageType:
    format: str
    media_type: str
    suffixes: tuple[str, ...]


IMAGE_TYPES = (
    ImageType("jpeg", "image/jpeg", (".jpg", ".jpeg")),
    ImageType("png", "image/png", (".png",)),
    ImageType("gif", "image/gif", (".gif",)),
    ImageType("webp", "image/webp", (".webp",)),
    ImageType("bmp", "image/bmp", (".bmp",)),
    ImageType("tiff", "image/tiff", (".tif", ".tiff")),
)
FORMATS = tuple(kind.format for kind in IMAGE_TYPES)
MEDIA_TYPES = tuple(kind.media_type for kind in IMAGE_TYPES)
"""The media types an image body may be sent as (with ``application/octet-stream``)."""
MEDIA_TYPE_OF = {kind.format: kind.media_type for kind in IMAGE_TYPES}
SUFFIXES = frozenset(suffix for kind in IMAGE_TYPES for suffix in kind.suffixes)


def is_image_file(path: Path) -> bool:
    """Whether a file found in a folder is taken as an image (by its suffix, in any case)."""
    return path.is_file() and path.suffix.lower() in SUFFIXES
