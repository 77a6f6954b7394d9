"""The torch.distributed.checkpoint (DCP) storage of DepthBench checkpoints: a writer that
checksums each rank's own files and completes a checkpoint atomically, and a reader that cannot
execute code.

Writing (every rank, `HashingWriter`): DCP's FileSystemWriter writes this rank's tensors (its
FSDP2 shards; under DDP an even share of the replicated tensors, DCP's de-duplication) to
`__<rank>_0.distcp` in the checkpoint's temporary folder. Right after, still inside DCP's save,
the rank hashes its own files and writes `rank_<r>.sha256` (sha256sum format), so no process
reads another rank's bytes. DCP's save protocol then gathers every rank's write results to the
coordinator (rank 0) and calls `finish` there: by then every rank's data and listing exist.
`finish` writes DCP's `.metadata` and hands over to `on_finish` (depthbench.train.checkpoint_folder:
manifest, rename). Under `dcp.async_save` all of this runs in DCP's background thread.

Reading (`SafeReader`): DCP's own `.metadata` is a pickle, read by `pickle.load`, and DCP loads
non-tensor entries by unpickling them without restriction: either would run code from a crafted
checkpoint. The reader unpickles the metadata with an allow-list of DCP's metadata classes (plus
torch.Size, dtypes, layouts and paths) and refuses a checkpoint with any non-tensor entry
(DepthBench writes none: non-tensor state goes into JSON). Tensor data itself is read by DCP with
`torch.load(weights_only=True)`; `check_tensor_data` reads it the same way before DCP copies any
of it into the model, so that an entry whose bytes are not the tensor its metadata describes (a
pickled object, another shape or dtype) rejects the checkpoint while the model is untouched.
"""

from __future__ import annotations

import io
import math
import pickle
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from depthbench.train.listing import METADATA, rank_listing, write_listing


class HashingWriter(FileSystemWriter):
    """FileSystemWriter that lists its rank's files with their sha256 (`rank_<r>.sha256`, also
    covering `extra_files` this rank wrote beforehand) and calls `on_finish()` on the coordinator
    once DCP's `.metadata` is written."""

    def __init__(
        self, path: Path, rank: int, extra_files: list[str], on_finish: Callable[[], None]
    ):
        # one file per rank, fsynced: a checkpoint's bytes are on disk before it counts
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.folder, self.my_rank, self.extra_files, self.on_finish = (
            Path(path),
            rank,
            extra_files,
            on_finish,
        )

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        results = future.wait()  # FileSystemWriter writes synchronously; its future is complete
        files = {r.storage_data.relative_path for r in results} | set(self.extra_files)
        write_listing(self.folder, rank_listing(self.my_rank), sorted(files))
        return future

    def finish(self, metadata: Metadata, results) -> None:
        super().finish(metadata, results)
        self.on_finish()


# What DCP's metadata pickle may reference (torch 2.13's, with plain, DDP and FSDP2 state
# dicts); anything else makes the checkpoint refused, not loaded.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "ChunkStorageMetadata",
        "TensorProperties",
        "TensorStorageMetadata",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"metadata references {module}.{name}, which a DCP checkpoint of DepthBench never holds"
        )


def read_metadata(folder: Path) -> Metadata:
    """DCP's metadata of the checkpoint in `folder`, unpickled without executing code; ValueError
    when it references anything but DCP's metadata classes or holds a non-tensor entry."""
    with open(folder / METADATA, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except Exception as exc:
            raise ValueError(
                f"{METADATA} not loadable without executing code ({type(exc).__name__}: {exc})"
            ) from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{METADATA} holds a {type(metadata).__name__}, not DCP metadata")
    objects = [
        k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)
    ]
    if objects:  # DCP would unpickle these without restriction
        raise ValueError(
            f"{METADATA} lists non-tensor entries {objects[:3]}: "
            "not loadable without executing code"
        )
    return metadata


def check_tensor_data(
    folder: Path, metadata: Metadata, share: tuple[int, int] = (0, 1)
) -> str | None:
    """None when every stored tensor chunk of the checkpoint in `folder` (every n-th from the
    i-th, `share` = (i, n)) loads with `torch.load(weights_only=True)` as a tensor of the dtype
    and chunk size its metadata gives, else what is wrong with the first one that does not."""
    items = sorted(
        metadata.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)
    )
    for index, info in items[share[0] :: share[1]]:
        where = f"tensor {index.fqn!r} in {info.relative_path}"
        if getattr(info, "transform_descriptors", None):
            return (
                f"{where} is stored with transforms {list(info.transform_descriptors)}, "
                "which DepthBench never writes"
            )
        entry = metadata.state_dict_metadata.get(index.fqn)
        chunk = next(
            (c for c in getattr(entry, "chunks", []) if tuple(c.offsets) == tuple(index.offset)),
            None,
        )
        if chunk is None:
            return f"{where}: its metadata lists no chunk at offset {tuple(index.offset)}"
        with open(folder / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            return f"{where}: {len(data)} bytes where the metadata says {info.length} (truncated)"
        try:
            value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            return (
                f"{where} holds a pickled object, not a tensor "
                "(refused: loading it would execute code)"
            )
        except Exception as exc:
            return (
                f"{where} is not a loadable tensor "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
            )
        if not isinstance(value, torch.Tensor):
            return f"{where} holds a {type(value).__name__}, not a tensor"
        if value.dtype != entry.properties.dtype or value.numel() != math.prod(chunk.sizes):
            return (
                f"{where} holds a {value.dtype} tensor of {value.numel()} elements "
                "where the metadata says "
                f"{entry.properties.dtype} of shape {tuple(chunk.sizes)}"
            )
    return None


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata comes from `read_metadata` (no code execution)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata
