"""Per-block compile and FSDP2 (depthbench.train.parallelize) where they start processes: inductor
(which loads each compiled block in a fresh interpreter to check it) under full checkpointing,
and 2 gloo ranks running checkpointing, block compile and FSDP2 with the CPU policy, held to
one plain rank."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from depthbench.train.parallelize import wrap_units
from tests.parallel_models import VOCAB, assert_same, tiny


@pytest.mark.slow
def test_inductor_block_compile_with_checkpointing_matches_eager():
    """The GPU presets' path on CPU: full checkpointing inside per-block inductor graphs."""
    model = tiny("lns", n_layer=2)
    reference = copy.deepcopy(model)
    counters.clear()
    wrap_units(model, "full", "block", backend="inductor")
    assert_same(model, reference, torch.randint(0, VOCAB, (2, 9)), atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


STEPS, BATCH = 3, 4


def _train(step_fn, model, idx, steps=STEPS):
    """A few SGD steps on `idx`; the losses (this rank's). SGD, not AdamW: AdamW's first steps
    move every weight by about lr whatever its gradient's size, so a gradient near zero whose
    rounding differs between 1 and 2 ranks would move a weight the other way."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        loss = step_fn(idx[:, :-1], idx[:, 1:]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses)


def _fsdp_worker(rank, world, store, archs, out):
    """One gloo rank: checkpointing, block compile, then FSDP2 with the CPU policy (parallelize's
    order), on this rank's rows of the batch; rank 0 saves the mean losses and full weights."""
    import torch.distributed as dist

    from depthbench.spec.training import TrainConfig
    from depthbench.train.distributed import DistContext, full_model_state
    from depthbench.train.parallelize import parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {}
    for arch in archs:
        model = tiny(arch, n_layer=2)
        tc = TrainConfig(parallel="fsdp", activation_checkpointing="full", compile="block")
        ctx = DistContext(rank, world, rank, "fsdp")
        _, step_fn, mode = parallelize(
            model, tc, ctx, torch.device("cpu"), torch.float32, backend="aot_eager"
        )
        assert mode == "full"
        idx = torch.randint(0, VOCAB, (BATCH, 9), generator=torch.Generator().manual_seed(1))
        losses = _train(step_fn, model, idx[rank::world])
        dist.all_reduce(losses)
        state = full_model_state(model, ctx)
        results[arch] = (losses / world, {k: v.clone() for k, v in state.items()})
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_with_the_policy_checkpointing_and_block_compile_equals_one_rank(tmp_path):
    """2 gloo ranks, each half the batch: the same losses and weights as one plain rank."""
    import torch.multiprocessing as mp

    # attnres_full: its checkpoint (and compile) units, PreNormed, contain its FSDP2 units
    archs = ["pre_ln", "moda", "attnres_full"]
    mp.spawn(
        _fsdp_worker,
        args=(2, str(tmp_path / "store"), archs, str(tmp_path / "out.pt")),
        nprocs=2,
        join=True,
    )
    results = torch.load(tmp_path / "out.pt", weights_only=True)
    for arch in archs:
        model = tiny(arch, n_layer=2)
        idx = torch.randint(0, VOCAB, (BATCH, 9), generator=torch.Generator().manual_seed(1))
        ref_losses = _train(model, model, idx)
        losses, state = results[arch]
        torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-5, msg=arch)
        for name, p in model.state_dict().items():
            torch.testing.assert_close(state[name], p, rtol=0, atol=1e-5, msg=f"{arch} {name}")
