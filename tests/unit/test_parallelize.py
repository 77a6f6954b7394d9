"""Activation checkpointing and per-block compile (depthbench.train.parallelize) on CPU.

- Checkpointing (full and selective) gives the loss and gradients of the plain model, bitwise,
  for every architecture (the recomputation runs the same kernels on the same inputs).
- It lowers the memory held after the forward, measured independently of the estimator: every
  storage any op creates during the forward is tracked through a weak reference, and the live
  ones are summed once the forward is done (what the graph keeps for backward, checkpoint
  inputs included). The estimator's prediction (depthbench.train.activation_trace, traced on
  the meta device) is within its stated fp32 tolerance of 10 % in every mode.
- Per-block compile (aot_eager on every architecture; inductor in one slow test) gives the eager
  loss and gradients, and LNS and DeepNorm compile one graph that serves every layer.
"""

import copy
import gc

import pytest
import torch
from torch._dynamo.utils import counters
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from depthbench import kernels
from depthbench.util.errors import ConfigError
from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model
from depthbench.train.activation_trace import trace_activations
from depthbench.train.memory import recompute_mask
from depthbench.train.parallelize import compile_mode, mixed_precision_policy, wrap_units
from depthbench.models.registry import PACKAGE_ARCHITECTURES

ARCHS = list(PACKAGE_ARCHITECTURES)  # every architecture of the package
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


@pytest.fixture(autouse=True)
def _eager_paths():
    """The PyTorch code of HC/mHC (the CPU C++ kernels never run on CUDA, where this matters)."""
    with kernels.disabled():
        yield


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_gives_the_same_loss_and_gradients(arch, mode):
    model = tiny(arch)
    reference = copy.deepcopy(model)
    wrap_units(model, mode)
    assert_same(model, reference, torch.randint(0, VOCAB, (2, 17)))


def test_checkpointing_with_experts_keeps_the_load_balancing_loss():
    model = tiny("pre_ln", moe={"n_experts": 4, "top_k": 2})
    reference = copy.deepcopy(model)
    wrap_units(model, "full")
    assert_same(model, reference, torch.randint(0, VOCAB, (2, 17)))


class LiveStorages(TorchDispatchMode):
    """Every storage an op creates, through weak references: `live_bytes` sums those still alive."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.refs.append(
                    (StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
                )
        return out

    def live_bytes(self, exclude: set) -> int:
        gc.collect()
        return sum(
            {
                ref.cdata: n
                for ref, n in self.refs
                if not ref.expired() and ref.cdata not in exclude
            }.values()
        )


def held_after_forward(model, idx) -> int:
    """Bytes of the storages created by the forward and alive after it (views of the weights,
    such as a transposed matrix, are the weights' storage and not counted)."""
    weights = {
        StorageWeakRef(t.untyped_storage()).cdata for t in [*model.parameters(), *model.buffers()]
    }
    tracker = LiveStorages()
    with tracker:
        out = model(idx, targets=idx)
    loss = out.loss
    del out
    held = tracker.live_bytes(weights)
    loss.backward()  # the graph held what backward needs: it runs
    return held


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpointing_frees_memory_as_the_estimator_predicts(arch):
    """Measured bytes held after the forward drop with checkpointing; the meta-device estimate of
    every mode is within 10 % of the measurement."""
    N, T = 2, 32
    # the paths CUDA runs, which the meta trace takes: MoDA's chunked pair and AttnRes's batched
    # mix, whose buffers (held on a ctx, announced through held_for_backward) are live memory here
    cuda_path = {
        "moda": {"attention_impl": "chunked"},
        "attnres_full": {"depth_mix": "batched"},
        "attnres_block": {"depth_mix": "batched"},
    }
    options = {**FEW_ITERATIONS, **cuda_path.get(arch, {})}
    cfg = ModelConfig(
        arch=arch,
        vocab_size=VOCAB,
        d_model=48,
        n_layer=4,
        n_head=4,
        max_seq_len=T,
        arch_options=options,
    )
    with torch.device("meta"):
        trace = trace_activations(
            build_model(cfg, initialize=False),
            torch.zeros(N, T, dtype=torch.long, device="meta"),
            False,
            "cpu",  # the CPU's kernels, which the measurement below runs
        )
    idx = torch.randint(0, VOCAB, (N, T))
    held = {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = build_model(cfg)
        units = wrap_units(model, mode)
        held[mode] = held_after_forward(model, idx)
        est = trace.retained(recompute_mask(mode, len(units)))
        assert abs(est - held[mode]) <= 0.1 * held[mode], (arch, mode, est, held[mode])
    assert held["full"] < held["selective"] < held["none"], held
    assert held["full"] < 0.75 * held["none"], held


@pytest.mark.parametrize("arch", ARCHS)
def test_block_compile_matches_eager(arch):
    model = tiny(arch, n_layer=2)
    reference = copy.deepcopy(model)
    counters.clear()
    wrap_units(model, "none", "block", backend="aot_eager")
    assert_same(model, reference, torch.randint(0, VOCAB, (2, 9)), atol=1e-6)
    assert counters["stats"]["unique_graphs"] >= 1  # it was compiled


def _graphs(arch: str, n_layer: int, float_constant: str | None = None) -> int:
    model = tiny(arch, n_layer=n_layer)
    if float_constant:  # the constant as a Python float (the control)
        for block in model.blocks:
            value = float(block._buffers.pop(float_constant))
            setattr(block, float_constant, value)
    wrap_units(model, "none", "block", backend="eager")
    counters.clear()
    idx = torch.randint(0, VOCAB, (2, 9))
    model(idx[:, :-1], idx[:, 1:]).loss.backward()
    return counters["stats"]["unique_graphs"]


def test_position_bound_constants_compile_one_graph_for_every_layer():
    assert _graphs("lns", 4) == 1
    assert _graphs("deepnorm", 4) == 1
    # control: LNS's 1/sqrt(l) as a Python float is a constant of the graph, one graph per layer
    assert _graphs("lns", 4, float_constant="scale") == 4


@pytest.mark.slow
def test_inductor_block_compile_with_checkpointing_matches_eager():
    """The GPU presets' path on CPU: full checkpointing inside per-block inductor graphs."""
    model = tiny("lns", n_layer=2)
    reference = copy.deepcopy(model)
    counters.clear()
    wrap_units(model, "full", "block", backend="inductor")
    assert_same(model, reference, torch.randint(0, VOCAB, (2, 9)), atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


def test_settings_are_checked_and_the_policy_follows_the_device():
    assert (
        compile_mode(True) == "model"
        and compile_mode(False) == "none"
        and compile_mode("block") == "block"
    )
    with pytest.raises(ConfigError, match="train.compile"):
        compile_mode("blocks")
    with pytest.raises(ConfigError, match="train.activation_checkpointing"):
        wrap_units(tiny("pre_ln", n_layer=2), "every_other")
    gpu = mixed_precision_policy(torch.device("cuda"), torch.bfloat16)
    assert gpu.param_dtype == torch.bfloat16 and gpu.reduce_dtype == torch.float32
    assert mixed_precision_policy(torch.device("cpu"), torch.bfloat16).param_dtype is None


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


def test_a_run_with_checkpointing_trains_the_same_weights(tiny_data, tmp_path):
    """Through the trainer (depthbench.train.loop.train): train.activation_checkpointing full
    gives bitwise the weights and losses of none, and the schema refuses an unknown mode."""
    import dataclasses
    import json

    from safetensors.torch import load_file

    from depthbench.spec.schema import load_config
    from depthbench.train.recipe import RunPaths
    from depthbench.train.loop import train
    from conftest import tiny_config

    _, exp, data_dir = tiny_data
    spec = next(iter(exp.runs.values()))
    weights, losses = {}, {}
    for mode in ("none", "full"):
        run = dataclasses.replace(
            spec, train=dataclasses.replace(spec.train, activation_checkpointing=mode)
        )
        paths = RunPaths(tmp_path / mode / "run", tmp_path / mode / "work")
        assert train(run, data_dir, paths, progress=False)["status"] == "ok"
        weights[mode] = load_file(paths.weights)
        losses[mode] = [
            r["train_loss"]
            for r in map(json.loads, paths.curves.read_text().splitlines())
            if "train_loss" in r
        ]
    assert all(torch.equal(weights["full"][k], weights["none"][k]) for k in weights["none"])
    assert losses["full"] == losses["none"] and len(losses["none"]) > 0
    config = tiny_config(tmp_path / "corpus.jsonl")
    config["train"]["activation_checkpointing"] = "every_other"
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        load_config(config)
