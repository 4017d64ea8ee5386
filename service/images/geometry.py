"""Where a photo's pixels go in the model's input: the resize modes' arithmetic, apart from any pixels.

A model takes ``height x width`` pixels, made from the upright photo (its EXIF orientation applied)
in one of three ways (``Resize``):

* ``crop``: scaled, keeping its aspect ratio, to cover ``height / crop_fraction x width /
  crop_fraction``, and the centre ``height x width`` kept (for a square input: the shorter side to
  ``size / crop_fraction``, then the centre square, as ImageNet models are evaluated);
* ``stretch``: the whole photo scaled to ``height x width``, its aspect ratio ignored;
* ``letterbox``: scaled, keeping its aspect ratio, to fit inside ``height x width``, centred, and the
  rest padded with grey ``LETTERBOX_GREY`` (114, the YOLO convention: the mean grey YOLO models were
  trained with; an odd pixel of padding goes to the bottom or right, as YOLO's ``letterbox``).

Orientation is applied last, on the small result, never on the decoded photo: a ``Plan`` says what
to take from the image as decoded (the raw frame) and what size to resize it to there, the target's
height and width swapped for the orientations that turn the picture a quarter (5-8). A centred
region whose offset is odd rounds towards the start of each upright axis, so on an axis the
orientation reverses it rounds the other way in the raw frame: the result is exactly "orient first,
then resize", pixel for pixel.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

Resize = Literal["crop", "stretch", "letterbox"]
"""How a photo becomes the model's ``height x width`` (see the module's text)."""
RESIZE_MODES: tuple[Resize, ...] = get_args(Resize)
LETTERBOX_GREY = 114
"""The padding of ``letterbox``, in every channel."""

_REVERSED: dict[int, tuple[bool, bool]] = {
    1: (False, False),
    2: (False, True),
    3: (True, True),
    4: (True, False),
    5: (False, False),
    6: (True, False),
    7: (True, True),
    8: (False, True),
}
"""For each EXIF orientation: whether it reverses the raw frame's (rows, columns) axis."""


class Plan(NamedTuple):
    """How one decoded image becomes the model's input: in the raw frame (as decoded, before its
    orientation), the region ``y, x, height, width`` is resized to ``resized`` (rows, columns);
    oriented, that lands at ``top, left`` of the input (letterbox; 0, 0 where it fills it)."""

    y: int
    x: int
    height: int
    width: int
    resized: tuple[int, int]
    top: int = 0
    left: int = 0

    @property
    def enlarges(self) -> bool:
        """Whether the region is enlarged along either axis (fewer pixels than the result needs)."""
        return self.height < self.resized[0] or self.width < self.resized[1]


def enlarges(
    height: int, width: int, orientation: int, out: tuple[int, int], resize: Resize, crop_fraction: float
) -> bool:
    """Whether ``plan(...).enlarges``, worked out without making the plan (JPEG's reduced scales
    ask it up to three times per image, before decoding): a crop's region is shorter than the
    input on either axis, a stretched picture's side shorter than the input's, a letterboxed
    picture shorter than the input on both axes."""
    th, tw = (out[1], out[0]) if orientation in (5, 6, 7, 8) else out  # quarter_turn, inline: hot
    if resize == "stretch":
        return height < th or width < tw
    if resize == "letterbox":
        return height < th and width < tw
    return (
        min(height, max(1, round(crop_fraction * min(height, width * th / tw)))) < th
        or min(width, max(1, round(crop_fraction * min(width, height * tw / th)))) < tw
    )


def quarter_turn(orientation: int) -> bool:
    """Whether an EXIF orientation swaps the picture's width and height (5-8)."""
    return orientation in (5, 6, 7, 8)


def plan(height: int, width: int, orientation: int, out: tuple[int, int], resize: Resize, crop_fraction: float) -> Plan:
    """The ``Plan`` for a decoded ``height x width`` image with EXIF ``orientation`` (1-8; others
    count as 1), to become ``out`` (rows, columns, upright) by ``resize``."""
    turned = quarter_turn(orientation)
    th, tw = (out[1], out[0]) if turned else out  # the target in the raw frame
    if resize == "stretch":
        return Plan(0, 0, height, width, (th, tw))
    if resize == "letterbox":
        scale = min(th / height, tw / width)
        nh, nw = min(th, max(1, round(height * scale))), min(tw, max(1, round(width * scale)))
        uh, uw = (nw, nh) if turned else (nh, nw)
        return Plan(0, 0, height, width, (nh, nw), (out[0] - uh) // 2, (out[1] - uw) // 2)
    # crop: the region the scaled image's centre covers, in source pixels; for a square target,
    # round(crop_fraction * the shorter side) on both axes
    rows_reversed, columns_reversed = _REVERSED.get(orientation, (False, False))
    sh = min(height, max(1, round(crop_fraction * min(height, width * th / tw))))
    sw = min(width, max(1, round(crop_fraction * min(width, height * tw / th))))
    return Plan(_centre(height - sh, rows_reversed), _centre(width - sw, columns_reversed), sh, sw, (th, tw))


def _centre(spare: int, reversed_axis: bool) -> int:
    """Offset that centres a region with ``spare`` pixels left over; an odd one rounds towards the
    upright start, which an axis the orientation reverses has at its end."""
    return spare - spare // 2 if reversed_axis else spare // 2
