"""depthbench.util.safetensors_file writes the same bytes in every process: the safetensors
library keeps a file's metadata in a hash map seeded per process, and the writer's fixed order
makes this process and fresh interpreters that write the same tensors and metadata agree byte
for byte."""

from __future__ import annotations

import subprocess
import sys

import pytest

WRITE = """
import sys, torch
from depthbench.util.safetensors_file import save_safetensors
g = torch.Generator().manual_seed(1)
save_safetensors({"w": torch.randn(4, 4, generator=g), "b": torch.randn(4, generator=g)},
                 sys.argv[1], {"run_id": "r1", "step": "9", "arch": "pre_ln", "seed": "0"})
"""


@pytest.mark.slow
def test_every_process_writes_the_same_bytes(tmp_path):
    """The library keeps metadata in a hash map seeded per process: with these four keys, this
    process and three others all writing the same order happens with probability about
    (1/24)^3 under its writer."""
    paths = [tmp_path / f"w{i}" for i in range(4)]
    exec(WRITE.replace("sys.argv[1]", repr(str(paths[0]))), {})
    for path in paths[1:]:
        subprocess.run([sys.executable, "-c", WRITE, str(path)], check=True)
    assert len({path.read_bytes() for path in paths}) == 1
