"""Trainable parameters and their gradients, in one process: moda's unread last ffn_kv projection
is frozen and still counted, and FSDP2 on one gloo rank gives the unsharded model's loss and
gradients for the chunked loss, the MoE experts and a frozen parameter."""

import copy

import pytest
import torch


def test_the_unread_last_ffn_kv_projection_is_frozen_and_counted():
    from depthbench.models.config import ModelConfig
    from depthbench.models.registry import build_model

    model = build_model(
        ModelConfig(
            arch="moda",
            vocab_size=64,
            d_model=32,
            n_layer=3,
            n_head=2,
            max_seq_len=16,
            arch_options={"variant": "ffn_kv"},
        )
    )
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == ["blocks.2.ffn_kv.weight"]
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())
    out = model(torch.randint(0, 64, (1, 16)), torch.randint(0, 64, (1, 16)))
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "arch, model_kw",
    [
        ("pre_ln", {"moe": {"n_experts": 4, "top_k": 2}}),
        ("moda", {"arch_options": {"variant": "ffn_kv"}}),
    ],
)
def test_fsdp2_shards_the_chunked_loss_moe_and_the_frozen_projection(tmp_path, arch, model_kw):
    """One gloo rank in this process: FSDP2 gathers the LM head for the chunked loss (which reads
    the weight, not the module), the grouped expert products and a frozen parameter, with the
    unsharded model's loss and gradients."""
    import torch.distributed as dist

    from depthbench.models.config import ModelConfig
    from depthbench.models.registry import build_model
    from depthbench.train.distributed import shard

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        torch.manual_seed(0)
        model = build_model(
            ModelConfig(
                arch=arch,
                vocab_size=64,
                d_model=32,
                n_layer=3,
                n_head=2,
                max_seq_len=16,
                **model_kw,
            )
        )
        reference = copy.deepcopy(model)
        model.loss_chunk_tokens = reference.loss_chunk_tokens = 7  # 16 target tokens: three chunks
        shard(model)
        idx = torch.randint(0, 64, (2, 9))
        out, ref = model(idx[:, :-1], idx[:, 1:]), reference(idx[:, :-1], idx[:, 1:])
        assert out.logits is None and (out.loss - ref.loss).abs() <= 1e-6
        for o in (out, ref):
            (o.loss + (o.aux_loss if o.aux_loss is not None else 0)).backward()
        ref_grads = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            if not p.requires_grad:
                assert p.grad is None and ref_grads[name].grad is None, name
                continue
            torch.testing.assert_close(
                p.grad.full_tensor(), ref_grads[name].grad, rtol=1e-5, atol=1e-6, msg=name
            )
    finally:
        dist.destroy_process_group()
