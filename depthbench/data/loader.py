"""Deterministic, stateless batch sampling from token shards.

The concatenated train shards are cut into non-overlapping windows of seq_len + 1 tokens (window
i covers tokens [i*T, i*T + T]; inputs are the first T, targets the last T). Epoch e visits the
windows in the order of a permutation seeded by (seed, e). Global sample g is window
perm_{g // W}[g % W], and optimizer step s consumes samples s*B .. s*B + B - 1. The data position
is therefore just the step: resuming at step s reproduces exactly the batches an uninterrupted
run would see, and rank r of R takes every R-th micro-batch of the step, a disjoint slice.
"""

from __future__ import annotations

import numpy as np
import torch


class TokenWindows:
    """Windows of seq_len + 1 tokens over a list of raw token memmaps (no window spans files)."""

    def __init__(self, files: list[str], dtype: str, seq_len: int):
        self.seq_len = seq_len
        self.arrays = [
            np.memmap(f, dtype=np.dtype(dtype).newbyteorder("<"), mode="r") for f in files
        ]
        per_file = [max(0, (len(a) - 1) // seq_len) for a in self.arrays]
        self.cum = np.cumsum([0] + per_file)
        self.n_tokens = int(sum(len(a) for a in self.arrays))
        if self.cum[-1] == 0:
            raise ValueError(f"{files}: fewer than seq_len + 1 = {seq_len + 1} tokens")

    def __len__(self) -> int:
        return int(self.cum[-1])

    def window(self, i: int) -> np.ndarray:
        f = int(np.searchsorted(self.cum, i, side="right") - 1)
        start = (i - int(self.cum[f])) * self.seq_len
        return np.asarray(self.arrays[f][start : start + self.seq_len + 1], dtype=np.int64)

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.from_numpy(np.stack([self.window(int(i)) for i in indices]))
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()


class ShuffledSampler:
    """Maps a global sample index to a window index via per-epoch seeded permutations."""

    def __init__(self, n_windows: int, seed: int):
        self.n = n_windows
        self.seed = seed
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def __call__(self, g: int) -> int:
        epoch, pos = divmod(g, self.n)
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._epoch = epoch
        return int(self._perm[pos])


class TrainBatches:
    """Micro-batches for (step, micro) of a run, for rank `rank` of `world` ranks."""

    def __init__(
        self,
        windows: TokenWindows,
        seed: int,
        global_batch: int,
        micro_batch: int,
        rank: int = 0,
        world: int = 1,
    ):
        if global_batch % (micro_batch * world):
            raise ValueError(
                f"global batch {global_batch} is not a multiple of "
                f"micro batch {micro_batch} x {world} ranks"
            )
        self.windows = windows
        self.sampler = ShuffledSampler(len(windows), seed)
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.rank, self.world = rank, world
        self.accum_steps = global_batch // (micro_batch * world)

    def get(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        # The step's samples form global_batch / micro_batch micro-batches k; rank r's micro-batch
        # m is k = m * world + r. Every rank computes exactly micro-batches that one rank would,
        # so R ranks sum the same per-micro-batch gradients as one rank (only the order of the
        # additions differs) and the losses agree to rounding.
        k = micro * self.world + self.rank
        base = step * self.global_batch + k * self.micro_batch
        return self.windows.batch([self.sampler(base + j) for j in range(self.micro_batch)])


def eval_batches(windows: TokenWindows, n_batches: int, micro_batch: int):
    """The fixed validation sample: the first n_batches * micro_batch windows, in order."""
    n = min(len(windows), n_batches * micro_batch)
    for start in range(0, n, micro_batch):
        yield windows.batch(range(start, min(n, start + micro_batch)))
