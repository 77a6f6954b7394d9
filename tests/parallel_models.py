"""Tiny models of every architecture and the loss-and-gradient comparison that the activation
checkpointing and per-block compile tests share (tests/unit/test_parallelize.py in-process,
tests/integration/test_parallelize_ranks.py with inductor and gloo ranks)."""

import torch

from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model

VOCAB = 64


# mHC's 20 Sinkhorn iterations are 20x the ops of a plain block (slow to trace and compile);
# the wrappers under test do not depend on the count
FEW_ITERATIONS = {"sinkhorn_iterations": 3}


def tiny(arch: str, n_layer: int = 3, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    extra.setdefault("arch_options", FEW_ITERATIONS)
    model = build_model(
        ModelConfig(
            arch=arch,
            vocab_size=VOCAB,
            d_model=32,
            n_layer=n_layer,
            n_head=2,
            max_seq_len=16,
            **extra,
        )
    )
    for p in model.parameters():  # away from zero-initialised queries and dynamic weights
        p.data.add_(0.05 * torch.randn_like(p))
    return model


def loss_and_grads(model, idx):
    out = model(idx[:, :-1], idx[:, 1:])
    objective = out.loss if out.aux_loss is None else out.loss + out.aux_loss
    objective.backward()
    return out.loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def assert_same(model, reference, idx, atol=0.0):
    loss, grads = loss_and_grads(model, idx)
    ref_loss, ref_grads = loss_and_grads(reference, idx)
    assert grads.keys() == ref_grads.keys()
    assert abs(float(loss - ref_loss)) <= atol  # bitwise unless a tolerance is given
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=atol, msg=name)
