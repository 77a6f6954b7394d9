"""HC's and mHC's sublayer connections on the CPU, through the C++ kernels (depthbench/kernels).

Swapped in by depthbench.kernels.swap for `HyperConnection` and `ManifoldHyperConnection` on the
CPU backend. The whole read, from the streams H to the sublayer input, the mixed streams and the
coefficients, runs in one C++ kernel per direction (hc_ops.read, mhc_ops.read; custom ops under
torch.compile), and the write after it in one more (stream_ops.write_after_read): eager PyTorch
runs each as tens of small kernels over the n-wide state. Where a kernel cannot take the input
(another device or dtype, more than 16 streams for HC, the kernels not built) the forward is the
architecture's own. On the meta device the custom ops' fake implementations stand in, so that
the memory estimate traces what these save. mHC's bf16 streams on the CPU take only the
coefficients in C++ (`fused_coefficients`: the sigmoids and Sinkhorn iterations from their
pre-activations).
"""

from __future__ import annotations

from typing import Callable

import torch

from depthbench import kernels
from depthbench.kernels import hc_ops, mhc_ops
from depthbench.kernels.stream_ops import write_after_read
from depthbench.models.archs.hc import HyperConnection
from depthbench.models.archs.mhc import ManifoldHyperConnection
from depthbench.models.layers import normed_linear
from depthbench.models.streams import mix_matrix, write_streams

HC_MAX_STREAMS = 16  # hc.cpp's limit
FULL_PRECISION = (torch.float32, torch.float64)


def takes(t: torch.Tensor) -> bool:
    """Whether the C++ kernels can run on t's device at all: a CPU tensor, the kernels built
    (`kernels.built` is a constant to torch.compile). On the meta device the kernels' custom ops
    run their fake implementations, which save what the kernels save: the memory estimate's
    trace of a CPU run."""
    return t.device.type in ("cpu", "meta") and kernels.built()


class CpuHyperConnection(HyperConnection):
    def forward(self, H: torch.Tensor, sublayer_fn: Callable[[torch.Tensor], torch.Tensor]):
        n = self.n
        if not (takes(H) and H.dtype in FULL_PRECISION and n <= HC_MAX_STREAMS):
            return super().forward(H, sublayer_fn)
        B, T, _, d = H.shape
        weight = self.dynamic.weight * self.norm.weight  # N(H_i) W^T = (H_i (g * W)^T) / rms(H_i)
        x, mixed, coeff = hc_ops.read(
            H.reshape(B * T, n, d),
            weight.to(H.dtype),
            self.static().to(H.dtype),
            self.scales().to(H.dtype),
            self.norm.eps,
        )
        out = sublayer_fn(x.view(B, T, d))
        H = write_after_read(mixed, coeff[..., n + 1], out.reshape(B * T, d), (B, T, n, d))
        coeff = coeff.view(B, T, n, n + 2)
        return H, coeff[..., 1 : n + 1].mT


class CpuManifoldHyperConnection(ManifoldHyperConnection):
    def forward(self, H: torch.Tensor, sublayer_fn: Callable[[torch.Tensor], torch.Tensor]):
        if not takes(H):
            return super().forward(H, sublayer_fn)
        B, T, n, d = H.shape
        gains, biases = self.gains_and_biases()
        if H.dtype in FULL_PRECISION:
            weight = (self.phi.weight * self.norm.weight).to(H.dtype)  # (h (g * Phi)) / rms(h)
            x, mixed, coeff, post, _ = mhc_ops.read(
                H.reshape(B * T, n, d),
                weight,
                gains.to(H.dtype),
                biases.to(H.dtype),
                self.norm.eps,
                self.iterations,
            )
            out = sublayer_fn(x.view(B, T, d))
            H = write_after_read(mixed, post, out.reshape(B * T, d), (B, T, n, d))
            return H, coeff.view(B, T, n + 1, n)[..., 1:, :]
        # bf16 streams: the projection in PyTorch, the coefficients from u = g * z + b in C++
        # (autograd gives the gains' and biases' gradients through u)
        z = normed_linear(H.reshape(B, T, n * d), self.norm, self.phi)
        u = torch.addcmul(biases.to(z.dtype), z, gains.to(z.dtype))
        coeff, post = mhc_ops.fused_coefficients(u.reshape(B * T, -1), n, self.iterations)
        coeff = coeff.view(B, T, n + 1, n)
        x, mixed = mix_matrix(coeff.to(H.dtype), H).split([1, n], dim=-2)
        out = sublayer_fn(x.squeeze(-2))
        H = write_streams(mixed, post.view(B, T, n).to(H.dtype), out)
        return H, coeff[..., 1:, :]


SWAPS = {
    ("cpu", HyperConnection): CpuHyperConnection,
    ("cpu", ManifoldHyperConnection): CpuManifoldHyperConnection,
}
