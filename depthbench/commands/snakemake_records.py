"""What Snakemake has recorded about a job's outputs, read without calling Snakemake: file times,
the jobs it marked incomplete (.snakemake/incomplete/), and the input checksums it keeps in
.snakemake/metadata/ (an input of at most --max-checksum-file-size bytes whose SHA-256 is
unchanged does not redo the job, however new its time). depthbench.commands.status builds each
run's state from these."""

from __future__ import annotations

import os
from pathlib import Path


def file_mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def newer_input(output: Path, inputs: list[Path]) -> Path | None:
    """The first input newer than `output` (Snakemake's mtime trigger), or None."""
    out = file_mtime(output)
    for path in inputs:
        t = file_mtime(path)
        if out is not None and t is not None and t > out:
            return path
    return None


MAX_CHECKSUM_FILE_SIZE = 1_000_000  # Snakemake's default --max-checksum-file-size (bytes)


def snakemake_record(root: Path, kind: str, path: Path) -> Path:
    """Where Snakemake keeps its record of kind `kind` (metadata, incomplete) about `path`: under
    .snakemake/<kind>/ in its working directory `root`, named by the URL-safe base64 of the path
    as the workflow spells it (relative to `root`), cut into parts of at most NAME_MAX - 1
    characters, every part but the last prefixed by '@' (snakemake.persistence)."""
    import base64

    key = base64.urlsafe_b64encode(os.path.relpath(path, root).encode()).decode()
    parts = [key[i : i + 254] for i in range(0, len(key), 254)]
    return root.joinpath(".snakemake", kind, *["@" + p for p in parts[:-1]], parts[-1])


def incomplete_outputs(root: Path, outputs: list[Path]) -> list[Path]:
    """The outputs Snakemake marked incomplete: a job that wrote them started and never finished
    (killed). A marked output that is gone is simply missing, as for Snakemake."""
    return [
        path
        for path in outputs
        if snakemake_record(root, "incomplete", path).exists() and path.exists()
    ]


def same_checksum(root: Path, outputs: list[Path], path: Path) -> bool:
    """Snakemake's exception to its mtime trigger: an input no larger than
    MAX_CHECKSUM_FILE_SIZE whose SHA-256 equals the one recorded for it in every output's
    metadata (one checksum for all) has not changed, however new its mtime."""
    import hashlib
    import json

    if not path.is_file() or path.stat().st_size > MAX_CHECKSUM_FILE_SIZE:
        return False
    recorded = set()
    for output in outputs:
        try:
            meta = json.loads(snakemake_record(root, "metadata", output).read_text())
        except (OSError, ValueError):
            return False
        checksum = (meta.get("input_checksums") or {}).get(os.path.relpath(path, root))
        recorded.add(checksum if checksum is None or ":" in checksum else f"sha256:{checksum}")
    if len(recorded) != 1 or None in recorded:
        return False
    return recorded.pop() == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def updated_input(root: Path, outputs: list[Path], inputs: list[Path]) -> Path | None:
    """The first input that makes Snakemake (9, default rerun triggers) redo the job of `outputs`
    by its mtime: newer than the oldest output and not excused by `same_checksum`; or None."""
    times = [file_mtime(path) for path in outputs]
    if not times or None in times:
        return None
    for path in inputs:
        t = file_mtime(path)
        if t is not None and t > min(times) and not same_checksum(root, outputs, path):
            return path
    return None
