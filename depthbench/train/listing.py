"""The checksum listings of a DepthBench checkpoint folder: sha256 of files, in sha256sum format.

Free of torch.distributed.checkpoint (importing DCP costs about a second, and every probe, NLL
and status call checks or reads checkpoints without writing one): the DCP writer and reader
that produce these files live in depthbench.train.dcp_io, imported only where a checkpoint is
saved or loaded.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from depthbench.util.io import atomic_write_text

METADATA = ".metadata"  # DCP's name for its metadata file


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def rank_listing(rank: int) -> str:
    return f"rank_{rank}.sha256"


def write_listing(folder: Path, name: str, files: list[str]) -> None:
    """`name` in sha256sum format over `files` (names inside `folder`): `sha256sum -c` checks it."""
    lines = [f"{file_sha256(folder / f)}  {f}\n" for f in sorted(files)]
    atomic_write_text(folder / name, "".join(lines))


def read_listing(path: Path) -> dict[str, str]:
    """{file name: sha256} from a sha256sum-format file; ValueError when malformed."""
    out = {}
    for line in path.read_text(errors="replace").splitlines():
        fields = line.split()
        if (
            len(fields) != 2
            or len(fields[0]) != 64
            or any(c not in "0123456789abcdef" for c in fields[0])
        ):
            raise ValueError(f"{path.name} is malformed (expected '<sha256>  <file>' lines)")
        out[fields[1]] = fields[0]
    return out
