"""depthbench.util.safetensors_file: files the library reads back, byte for byte the library's own
where its bytes are deterministic; bad input is refused naming the tensor or key."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from depthbench.util.safetensors_file import DTYPE_CODES, save_safetensors

DTYPES = [getattr(torch, name) for name in DTYPE_CODES]


def every_dtype() -> dict:
    """One tensor of each dtype, in odd sizes (so a tensor after a narrower one would sit
    misaligned unless the order keeps wider dtypes first), plus a scalar and an empty tensor."""
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i, dtype in enumerate(DTYPES):
        values = torch.randn(3, 5 + i, generator=g) * 4
        tensors[f"t{i:02d}.{str(dtype)[6:]}"] = (
            (values > 0) if dtype is torch.bool else values.to(dtype)
        )
    tensors["scalar"] = torch.tensor(1.5, dtype=torch.float64)
    tensors["empty"] = torch.zeros(0, 4)
    tensors["strided"] = torch.arange(24.0).reshape(4, 6).t()  # not contiguous
    return tensors


def bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def test_round_trip_through_the_library(tmp_path):
    tensors = every_dtype()
    path = tmp_path / "w.safetensors"
    save_safetensors(tensors, path, {"run_id": "r1", "step": "7", "a": "é"})
    loaded = load_file(str(path))
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert torch.equal(bytes_of(loaded[name]), bytes_of(tensor)), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"run_id": "r1", "step": "7", "a": "é"}


@pytest.mark.parametrize("metadata", [None, {}, {"run_id": "r1"}])
def test_bytes_equal_the_librarys_where_its_are_deterministic(tmp_path, metadata):
    """With at most one metadata key the library's own bytes are fixed: ours must equal them
    (the same header, order, padding and data), every dtype included."""
    tensors = every_dtype()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "lib"), metadata)
    save_safetensors(tensors, tmp_path / "ours", metadata)
    assert (tmp_path / "ours").read_bytes() == (tmp_path / "lib").read_bytes()


def test_bad_input_names_the_tensor_or_key(tmp_path):
    with pytest.raises(ValueError, match="tensor 'z': dtype complex64 .*valid: float64"):
        save_safetensors({"z": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "x")
    with pytest.raises(ValueError, match="'step': 3"):
        save_safetensors({"w": torch.zeros(2)}, tmp_path / "x", {"step": 3})
    with pytest.raises(ValueError, match="'__metadata__'"):
        save_safetensors({"__metadata__": torch.zeros(2)}, tmp_path / "x")
