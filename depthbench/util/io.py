"""Atomic writes: a reader never sees a partial file, and a crash never leaves one in place.

Files get the mode an ordinary `open()` would give them (0666 less the umask): `mkstemp`
creates its file 0600, and so do some library writers (safetensors' `save_file`, which
`save_pretrained` uses), which would make every result private to its owner on a shared cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call `write(tmp_path)` on a temporary file beside `path`, fsync it, then rename over
    `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        # after: a writer that replaces the file (safetensors) gets it too
        os.chmod(tmp, 0o666 & ~current_umask())
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder beside `path` to fill; on success it gets an ordinary folder's
    mode (0777 less the umask; mkdtemp makes it 0700), everything in it the mode open() or mkdir
    would give (`follow_umask`), and it takes `path`'s place: whatever was at
    `path` (a folder, a file or a link) is first renamed aside, the new folder renamed in, and the
    old one removed only then (renamed back if the second rename fails). On any error the
    temporary folder is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        follow_umask(tmp)
        old = None
        if path.exists() or path.is_symlink():
            old = (
                Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
                / "old"
            )
            os.replace(path, old)
        try:
            os.replace(tmp, path)
        except BaseException:
            if old is not None:
                os.replace(old, path)
                os.rmdir(old.parent)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # the new folder is in place: the old one goes (a failure here loses nothing new)
    if old is not None:
        shutil.rmtree(old.parent, ignore_errors=True)


def follow_umask(folder: str | os.PathLike) -> None:
    """Give `folder` and everything under it the mode an ordinary mkdir or open() would have
    given (folders and files executable by their owner 0777, other files 0666, less the umask),
    whatever mode the writer chose. Links are left alone."""
    umask = current_umask()
    for root, dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~umask)
        for name in files:
            path = os.path.join(root, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISREG(mode):
                os.chmod(path, (0o777 if mode & stat.S_IXUSR else 0o666) & ~umask)


def current_umask() -> int:
    """The process umask, read from /proc (Linux) so that it is not set, even briefly, to 0;
    elsewhere by the set-and-restore idiom."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True, default=str)
            f.write("\n")

    atomic_write(path, write)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    def write(tmp: str) -> None:
        Path(tmp).write_text(text)

    atomic_write(path, write)
