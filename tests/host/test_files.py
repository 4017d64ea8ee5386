from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.host.files import atomic_write


def test_a_written_file_gets_the_mode_of_a_plain_open(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    path = tmp_path / "deep" / "file"
    with atomic_write(path) as out:
        out.write(b"data")
    assert path.read_bytes() == b"data"
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777 == 0o644


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "config.pbtxt"
    path.write_text("old")

    def write_half() -> None:
        with atomic_write(path, "w") as out:
            out.write("half")
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_half()
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["config.pbtxt"]
