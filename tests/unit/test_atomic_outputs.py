"""Outputs (files, parquet tables, checkpoints, folders) get the mode the umask gives an ordinary
file or folder, and replace what was there whole or not at all."""

from __future__ import annotations

import os

import pandas as pd
import pytest

from depthbench.util.io import atomic_write_text
from tests.run_outputs import save_step


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_outputs_get_the_mode_the_umask_allows(tmp_path, umask):
    from depthbench.analysis.tables import write_parquet

    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        write_parquet(pd.DataFrame({"a": [1]}), tmp_path / "t.parquet")
        save_step(tmp_path / "ck", 1)
        (tmp_path / "plain.txt").write_text("x")  # what open() gives: the reference
    finally:
        os.umask(old)
    want = (tmp_path / "plain.txt").stat().st_mode & 0o777
    assert want == 0o666 & ~umask
    ck = [
        f"ck/step_00000001/{n}"
        for n in (
            ".metadata",
            "__0_0.distcp",
            "rank_0.safetensors",
            "state.json",
            "state.json.sha256",
        )
    ]
    for p in ("a.txt", "t.parquet", *ck):
        assert (tmp_path / p).stat().st_mode & 0o777 == want, p


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_folder_is_replaced_whole_with_an_ordinary_folders_mode(tmp_path, umask):
    """atomic_folder (HF exports, published snapshots): the new folder replaces the old one only
    once it is complete, with mkdir's mode, and a failure leaves the old folder as it was."""
    from depthbench.util.io import atomic_folder

    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_folder(target) as tmp:
            (tmp / "new.txt").write_text("new")
            raise RuntimeError("killed half-way")
    assert [p.name for p in target.iterdir()] == ["old.txt"] and len(list(tmp_path.iterdir())) == 1
    old = os.umask(umask)
    try:
        with atomic_folder(target) as tmp:
            (tmp / "new.txt").write_text("new")
        (tmp_path / "plain").mkdir()  # what mkdir gives: the reference
    finally:
        os.umask(old)
    assert [p.name for p in target.iterdir()] == ["new.txt"]
    assert (
        target.stat().st_mode & 0o777
        == (tmp_path / "plain").stat().st_mode & 0o777
        == 0o777 & ~umask
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "out",
        "plain",
    ]  # no temporary or old folder left
    # a file, or a link, where the folder goes is replaced too
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(target)
    for name in ("file", "link"):
        with atomic_folder(tmp_path / name) as tmp:
            (tmp / "new.txt").write_text("new")
        assert (tmp_path / name).is_dir() and not (tmp_path / name).is_symlink()
    assert [p.name for p in target.iterdir()] == ["new.txt"]  # the link's target untouched


def test_a_folder_that_cannot_be_renamed_in_leaves_the_old_one(tmp_path, monkeypatch):
    from depthbench.util.io import atomic_folder

    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    real = os.replace

    def fail_on_the_new_folder(src, dst):
        if str(src).endswith(".tmp"):
            raise OSError("disk gone")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", fail_on_the_new_folder)
    with pytest.raises(OSError, match="disk gone"):
        with atomic_folder(target) as tmp:
            (tmp / "new.txt").write_text("new")
    assert [p.name for p in target.iterdir()] == ["old.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing temporary left
