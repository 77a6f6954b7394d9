"""DDP with find_unused_parameters=False on two spawned gloo ranks: an MoE model and moda's ffn_kv
variant train, every trainable parameter getting its gradient each step; the control, a parameter
no layer reads made trainable, fails DDP's reduction check."""

import json

import pytest
import torch


DDP_MODELS = {
    "moe": ("pre_ln", {"moe": {"n_experts": 4, "top_k": 1}}),
    "moda_ffn_kv": ("moda", {"arch_options": {"variant": "ffn_kv"}}),
}


def _ddp_steps(model, rank) -> str:
    """Three DDP steps (find_unused_parameters=False): "ok", or the error of a parameter whose
    gradient never arrived (raised at the step after, "Expected to have finished reduction")."""
    from torch.nn.parallel import DistributedDataParallel

    net = DistributedDataParallel(model)
    torch.manual_seed(1 + rank)
    try:
        for _ in range(3):
            idx = torch.randint(0, 64, (2, 16))
            out = net(idx, idx)
            (out.loss + (out.aux_loss if out.aux_loss is not None else 0)).backward()
    except RuntimeError as exc:
        return str(exc)[:80]
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    return f"no gradient: {missing}" if missing else "ok"


def _ddp_worker(rank, store, out_dir):
    import torch.distributed as dist

    from depthbench.models.config import ModelConfig
    from depthbench.models.registry import build_model

    torch.set_num_threads(1)  # two ranks on a shared machine: no oversubscribed thread pools
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    results = {}
    for name, (arch, kw) in DDP_MODELS.items():
        torch.manual_seed(0)
        model = build_model(
            ModelConfig(
                arch=arch, vocab_size=64, d_model=32, n_layer=3, n_head=2, max_seq_len=16, **kw
            )
        )
        results[name] = _ddp_steps(model, rank)
    # the control: the ffn_kv projection that no layer reads, made trainable again, trips the check
    torch.manual_seed(0)
    arch, kw = DDP_MODELS["moda_ffn_kv"]
    model = build_model(
        ModelConfig(arch=arch, vocab_size=64, d_model=32, n_layer=3, n_head=2, max_seq_len=16, **kw)
    )
    model.blocks[-1].ffn_kv.weight.requires_grad_(True)
    results["control"] = _ddp_steps(model, rank)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    del model
    dist.barrier()  # both ranks done before either tears gloo down (as training's teardown does)
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks
def test_ddp_trains_moe_and_moda_ffn_kv_without_find_unused_parameters(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_ddp_worker, args=(str(tmp_path / "store"), tmp_path), nprocs=2, join=True)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert results["moe"] == "ok" and results["moda_ffn_kv"] == "ok", results
        assert results["control"].startswith("Expected to have finished reduction"), results
