"""CUDA held to the CPU (skipped without CUDA): every architecture trained for a few steps in
float32 (TF32 off) on both devices from the same initialisation and batches gives the same losses,
and every probe, the removal losses and the logit lens measure the same trained weights alike on
both devices, within the tolerances below. Twice: with the architectures' definitions on both
devices (`kernels: reference`: the devices' numerics alone), and with each device's own
implementations swapped in as every stage swaps them (`auto`, depthbench.kernels.swap: Triton
kernels on CUDA, C++ on the CPU), whose tolerances are wider: Triton's float32 dot products may
round their operands through TF32 (about 1e-3 relative), whatever torch's settings say.

Tolerances: float32 kernels differ between the devices in summation order only, about 1e-7
relative per operation. After 8 AdamW steps the losses may drift apart by a few 1e-6 relative; a
probe value (a ratio of losses, a mean angle, a rank) by about 1e-5. The reference tolerances
leave ten times that and more, and are far below any effect the probes report (a
causal or permutation share moves by 1/pairs, a usefulness ratio by percents). The usefulness fits
are solved by gelsd on the CPU and by the pseudo-inverse on CUDA (depthbench.probes.interventions
.affine_fit): the same minimum-norm solution, so within the same tolerance. The summaries that
count scores above a threshold (`DISCRETE`) are not compared: a score within rounding of its
threshold may fall on either side, and the scores they count are compared."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from depthbench.kernels.swap import swap_in
from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model, registered_architectures
from depthbench.probes.measure import probe_model
from depthbench.probes.removal import ScoredTokens, removal_losses
from depthbench.probes.run import probe_settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (kernels: reference, auto)
LOSS_RTOL = {"reference": 1e-4, "auto": 5e-3}
PROBE_TOL = {"reference": (1e-3, 1e-4), "auto": (2e-2, 2e-3)}  # (relative, absolute)
STEPS, VOCAB = 8, 256
DISCRETE = {"causal_share", "permutation_share", "useful_fraction", "dead_zone_layers"}


@pytest.fixture(autouse=True)
def true_fp32():
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32 = saved[1]


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (4, 33), generator=g) for _ in range(n)]


def _train(model: torch.nn.Module, device: str, kernels: str) -> list[float]:
    """STEPS AdamW steps on one batch (foreach off on both devices: the same update order); the
    losses before each step, read once at the end."""
    swap_in(model.to(device), kernels=kernels).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    losses = []
    idx = _batches(1)[0].to(device)
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        out = model(idx[:, :-1], idx[:, 1:])
        loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses).cpu().tolist()


def _close(a: float, b: float, kernels: str) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    rtol, atol = PROBE_TOL[kernels]
    return abs(a - b) <= atol + rtol * abs(b)


@pytest.mark.parametrize("kernels", ["reference", "auto"])
@pytest.mark.parametrize("arch", registered_architectures())
def test_training_and_every_probe_agree_between_cuda_and_the_cpu(arch, kernels):
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, vocab_size=VOCAB, d_model=64, n_layer=4, n_head=4, max_seq_len=64)
    cpu = build_model(cfg)
    cuda = copy.deepcopy(cpu)
    on_cpu, on_cuda = _train(cpu, "cpu", kernels), _train(cuda, "cuda", kernels)
    assert on_cpu[-1] < on_cpu[0]  # it trained
    for a, b in zip(on_cuda, on_cpu):
        assert abs(a - b) <= LOSS_RTOL[kernels] * abs(b), (arch, kernels, on_cuda, on_cpu)

    # every probe on the same weights (the CPU-trained ones) on both devices
    cuda.load_state_dict(cpu.state_dict())
    cpu.eval(), cuda.eval()
    idx = _batches(2)[-1]  # another batch than the one trained on
    settings = {**probe_settings({}), "threads": 1, "bootstrap_seed": 0}
    rows = {
        device: {
            (r["probe"], r["i"], r["j"]): r
            for r in probe_model(model, idx.to(device), "trained", settings, full=True)
        }
        for device, model in (("cpu", cpu), ("cuda", cuda))
    }
    assert rows["cuda"].keys() == rows["cpu"].keys()
    probes = {key[0] for key in rows["cpu"]}
    assert {
        "angular_distance_last",
        "causal_score",
        "permutation_score",
        "lens_kl_to_final",
    } <= probes
    bad = [
        (key, field, rows["cuda"][key][field], row[field])
        for key, row in rows["cpu"].items()
        if key[0] not in DISCRETE
        for field in ("value", "ci_low", "ci_high")
        if not _close(rows["cuda"][key][field], row[field], kernels)
    ]
    assert not bad, bad[:10]

    data = {"val": ScoredTokens.windows(idx)}
    L = cfg.n_layer
    sets = [("last", 0, k, list(range(L - k, L))) for k in range(1, L)]
    full_cpu, by_set_cpu = removal_losses(cpu, sets, data)
    full_cuda, by_set_cuda = removal_losses(cuda, sets, {k: v.to("cuda") for k, v in data.items()})
    assert _close(full_cuda["val"], full_cpu["val"], kernels)
    for a, b in zip(by_set_cuda, by_set_cpu):
        assert _close(a["val"], b["val"], kernels), (a, b)
