from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.host.files import atomic_folder, atomic_write


def test_a_written_file_gets_the_mode_of_a_plain_open(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    path = tmp_path / "deep" / "file"
    with atomic_write(path) as out:
        out.write(b"data")
    assert path.read_bytes() == b"data"
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
    assert path.stat().st_mode & 0o044  # not the 0600 of mkstemp


def test_the_mode_follows_the_umask_of_the_moment(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        with atomic_write(tmp_path / "private") as out:
            out.write(b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "private").stat().st_mode & 0o777 == 0o600


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


def test_a_folder_replaces_the_old_one_whole_with_a_plain_mode(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    target = tmp_path / "int8"
    target.mkdir()
    (target / "stale").write_text("old")
    with atomic_folder(target) as tmp:
        (tmp / "model.xml").write_text("new")
        assert not (target / "model.xml").exists()  # nothing shows before the block ends
    assert sorted(os.listdir(target)) == ["model.xml"]
    assert target.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777

    def fail() -> None:
        with atomic_folder(target) as tmp:
            (tmp / "model.xml").write_text("half")
            raise RuntimeError("quantization refused")

    with pytest.raises(RuntimeError):
        fail()
    assert (target / "model.xml").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["int8", "plain"]
