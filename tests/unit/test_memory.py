"""The memory estimator (meta-device trace) against saved-for-backward bytes measured on CPU.

The reference runs the real model on real CPU tensors (eager path, as on CUDA) and sums the
bytes of every distinct storage autograd keeps, counted here independently of
depthbench.train.memory. The estimate traced with the CPU's autocast policy and MoE path
(`device="cpu"`) is held to it within 2 % in fp32 and under bf16 autocast, for every registered
architecture and for MoE experts (it is exact on these models); the CUDA trace, which the
planner uses, is held above it and within 1 % of it where the two devices run the same path
(depthbench.train.memory says where they differ). Fused SDPA on CPU saves q, k, v, output and
log-sum-exp, as the estimator assumes. The trace leaves nothing of its own behind: the kernels'
switch, the autocast replay and torch.autocast are as they were, during the trace and after.
"""

from contextlib import nullcontext
from unittest import mock

import pytest
import torch

from depthbench import kernels
from depthbench.kernels import precision
from depthbench.models import moe as moe_module
from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model
from depthbench.models.registry import registered_architectures
from depthbench.commands.plan import format_plan, plan_experiment
from depthbench.train.memory import estimate_memory

SHAPES = [dict(d_model=32, n_layer=2, n_head=2), dict(d_model=48, n_layer=4, n_head=4)]
N, T = 2, 16


def measured_saved_bytes(cfg: ModelConfig, bf16: bool, grouped_mm: bool = True) -> int:
    """`grouped_mm=False`: MoE experts take the every-expert path (CUDA's for fp32)."""
    torch.manual_seed(0)
    model = build_model(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    idx = torch.randint(0, cfg.vocab_size, (N, T))
    ctx = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if bf16
        else torch.autocast("cpu", enabled=False)
    )
    serves = (
        mock.patch("depthbench.models.moe._grouped_mm_serves", lambda *a: False)
        if not grouped_mm
        else nullcontext()
    )
    with kernels.disabled(), serves, ctx:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(idx, targets=idx)
    # tensors a custom autograd.Function keeps as ctx attributes rather than saving them (buffers
    # written in place by later layers) are found by walking the graph: every node of a Python
    # Function is its ctx
    for node in graph_nodes(out.loss.grad_fn):
        for value in getattr(node, "__dict__", {}).values():
            for t in flat_tensors(value):
                s = t.untyped_storage()
                if s.data_ptr() not in params:
                    storages[s.data_ptr()] = s.nbytes()
    out.loss.backward()  # the graph was real: backward runs from what was saved
    return sum(storages.values())


def graph_nodes(root):
    seen, todo = set(), [root]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        todo += [n for n, _ in node.next_functions]


def flat_tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from flat_tensors(v)


# the paths the meta trace takes off the CPU, as on CUDA: AttnRes's batched depth mix over its
# source buffer, MoDA's chunked pair over its depth K/V buffer (both buffers held on a ctx)
OFF_CPU_PATHS = {
    "attnres_full": {"depth_mix": "batched"},
    "attnres_block": {"depth_mix": "batched"},
    "moda": {"attention_impl": "chunked"},
}
MOE = {"n_experts": 4, "top_k": 2}
CASES = [(arch, {}) for arch in registered_architectures()] + [("pre_ln", MOE), ("hc", MOE)]
CASE_IDS = [arch + ("-moe" if moe else "") for arch, moe in CASES]


def case_configs(arch, moe):
    for shape in SHAPES:
        yield ModelConfig(
            arch=arch,
            vocab_size=96,
            max_seq_len=T,
            arch_options=OFF_CPU_PATHS.get(arch, {}),
            moe=moe,
            **shape,
        )


@pytest.mark.parametrize("arch, moe", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_activation_estimate_matches_cpu(arch, moe, bf16):
    """Within 2 % both ways, bf16 included: under bf16 autocast HC's and mHC's coefficient RMS
    (`linalg.vecdot`) takes two bf16 copies of the fp32 streams, 14 % and 7-8 % of their saved
    bytes; MoE experts take the grouped products, whose saved bytes are k/E of the dense path's."""
    for cfg in case_configs(arch, moe):
        est = estimate_memory(cfg, N, T, bf16=bf16, device="cpu").activations
        ref = measured_saved_bytes(cfg, bf16)
        assert abs(est - ref) <= 0.02 * ref, (arch, cfg.d_model, est, ref, est / ref)


@pytest.mark.parametrize("arch, moe", CASES, ids=CASE_IDS)
def test_cuda_estimate_bounds_the_cpu_count_from_above(arch, moe):
    """Under bf16 autocast CUDA runs rsqrt, exp, sum, softmax ... in fp32 where the CPU runs them
    in bf16, so the CUDA trace may save more, never less; on these models at most 1 % more (0.2 %
    for hc). In fp32 nothing is cast and both traces equal the measurement, but for MoE: CUDA's
    fp32 experts run every expert on every token, which the measurement on that path equals."""
    for cfg in case_configs(arch, moe):
        ref = measured_saved_bytes(cfg, True)
        est = estimate_memory(cfg, N, T, bf16=True, device="cuda").activations
        assert ref <= est <= 1.01 * ref, (arch, cfg.d_model, est, ref, est / ref)
        ref = measured_saved_bytes(cfg, False, grouped_mm=False)
        est = estimate_memory(cfg, N, T, bf16=False, device="cuda").activations
        assert abs(est - ref) <= 0.02 * ref, (arch, cfg.d_model, est, ref, est / ref)


def test_cuda_autocast_replay_runs_rsqrt_in_fp32():
    """The fp32 op lists per device: rsqrt of a bf16 matmul saves an fp32 result on CUDA, a bf16
    one on the CPU (CPU autocast leaves rsqrt to the input's dtype)."""
    from depthbench.train.activation_trace import trace_activations

    class Rms(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(8, 8))

        def checkpoint_units(self):
            return []

        def forward(self, idx, targets=None):
            return torch.rsqrt(
                torch.nn.functional.linear(idx.float()[..., None].expand(-1, -1, 8), self.w)
            )

    with torch.device("meta"):
        model = Rms()
    idx = torch.zeros(2, 4, dtype=torch.long, device="meta")
    # saved: linear's bf16 copy of its input (for the weight's gradient) and rsqrt's result
    cpu, cuda = (trace_activations(model, idx, True, device).total for device in ("cpu", "cuda"))
    assert cpu == 2 * (2 * 4 * 8) + 2 * (2 * 4 * 8)
    assert cuda == 2 * (2 * 4 * 8) + 4 * (2 * 4 * 8)
    with pytest.raises(ValueError, match="device"):
        trace_activations(model, idx, True, "tpu")


class Witness(torch.nn.Module):
    """A model that records, while it is traced, what model code meets: torch.autocast, the
    kernels' answer for a CPU fp32 tensor, the replay in force and the dtypes it answers."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(8, 8))
        self.unit = torch.nn.Linear(8, 8, bias=False)
        self.seen = {}

    def checkpoint_units(self):
        return [self.unit]

    def forward(self, idx, targets=None):
        x = idx.float()[..., None].expand(-1, -1, 8)
        self.seen.update(
            autocast=torch.autocast,
            apply_to=kernels.apply_to(torch.ones(2)),
            replay=precision.replay(),
            dtype=precision.autocast_dtype(x),
        )
        with precision.autocast_off(x.device.type):
            self.seen["dtype_off"] = precision.autocast_dtype(x)
        self.seen["dtype_after_off"] = precision.autocast_dtype(x)
        return self.unit(torch.nn.functional.linear(x, self.w))


def test_the_trace_changes_no_global_state():
    """During a meta trace the models meet the real torch.autocast, kernels that answer False and
    the replay of the target device; after it (and after one that fails) everything answers as
    before: no function of another module is swapped, no replay is left in force."""
    from depthbench.train.activation_trace import trace_activations

    cpu = torch.ones(2)
    before = {
        "autocast": torch.autocast,
        "apply_to": kernels.apply_to,
        "answer": kernels.apply_to(cpu),
        "compute_dtype": moe_module._compute_dtype,
        "serves": moe_module._grouped_mm_serves,
    }
    assert before["autocast"] is torch.amp.autocast_mode.autocast
    with torch.device("meta"):
        model = Witness()
    idx = torch.zeros(2, 4, dtype=torch.long, device="meta")
    for device in ("cpu", "cuda"):
        trace_activations(model, idx, True, device)
        seen = model.seen
        assert seen["autocast"] is torch.amp.autocast_mode.autocast
        assert seen["apply_to"] is False
        assert seen["replay"] == precision.Replay(device=device, enabled=True)
        assert (seen["dtype"], seen["dtype_off"], seen["dtype_after_off"]) == (
            torch.bfloat16,
            torch.float32,
            torch.bfloat16,
        )
    trace_activations(model, idx, False)
    assert model.seen["dtype"] == torch.float32 and model.seen["replay"].enabled is False
    with pytest.raises(ValueError, match="device"):
        trace_activations(model, idx, True, "tpu")
    after = {
        "autocast": torch.autocast,
        "apply_to": kernels.apply_to,
        "answer": kernels.apply_to(cpu),
        "compute_dtype": moe_module._compute_dtype,
        "serves": moe_module._grouped_mm_serves,
    }
    assert after == before
    assert precision.replay() is None
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    # on meta outside a trace: no replay, autocast_off a no-op, the tensor's own dtype
    with precision.autocast_off("meta"):
        assert precision.autocast_dtype(idx.float()) == torch.float32


def test_kernels_disabled_nests_and_restores():
    cpu = torch.ones(2)
    answer = kernels.apply_to(cpu)
    with kernels.disabled():
        with kernels.disabled():
            assert kernels.apply_to(cpu) is False
        assert kernels.apply_to(cpu) is False
    assert kernels.apply_to(cpu) == answer
    with pytest.raises(RuntimeError):
        with kernels.disabled():
            raise RuntimeError("a failed trace")
    assert kernels.apply_to(cpu) == answer


@pytest.mark.parametrize(
    "arch, options, n_kv_head",
    [
        ("attnres_full", {"depth_mix": "batched"}, 4),
        ("attnres_block", {"depth_mix": "batched", "n_blocks": 2}, 4),
        ("moda", {"attention_impl": "chunked"}, 4),
        ("moda", {"attention_impl": "chunked"}, 2),
        ("moda", {"attention_impl": "chunked", "variant": "ffn_kv"}, 4),
    ],
    ids=["full", "block", "moda", "moda-gqa", "moda-ffn_kv"],
)
def test_buffers_held_on_a_ctx_are_counted(arch, options, n_kv_head):
    """AttnRes's source buffer and MoDA's depth K/V buffer are kept for backward on a ctx, not
    through autograd's saved tensors (7 % of these models' saved bytes), while the tensors they
    copy live only where autograd keeps them (with GQA and ffn_kv, MoDA's attention does not
    save every depth key): the estimate equals the graph walk's count within 1 % in fp32, where
    the 10 % of the test above would let either error go."""
    cfg = ModelConfig(
        arch=arch,
        vocab_size=96,
        max_seq_len=T,
        arch_options=options,
        d_model=48,
        n_layer=4,
        n_head=4,
        n_kv_head=n_kv_head,
    )
    est, ref = estimate_memory(cfg, N, T, bf16=False).activations, measured_saved_bytes(cfg, False)
    assert abs(est - ref) <= 0.01 * ref, (est, ref)


def test_states_and_checkpointing_terms():
    cfg = ModelConfig(arch="pre_ln", vocab_size=96, max_seq_len=T, d_model=32, n_layer=4, n_head=2)
    n = sum(p.numel() for p in build_model(cfg).parameters())
    one = estimate_memory(cfg, N, T, bf16=False)
    sharded = estimate_memory(cfg, N, T, bf16=False, world=4, fsdp=True)
    assert one.weights == one.gradients == 4 * n and one.optimizer == 8 * n
    assert sharded.weights == n and sharded.optimizer == 2 * n and sharded.gathered > 0
    assert one.activations_checkpointed < one.activations
    # batch-linear: twice the micro-batch saves twice the activations
    assert estimate_memory(cfg, 2 * N, T, bf16=False).activations == pytest.approx(
        2 * one.activations, rel=0.01
    )


def test_plan_prints_totals(tmp_path):
    from depthbench.grid.config import expand_grid
    from depthbench.spec.schema import load_config

    exp = expand_grid(load_config("config/config.yaml"))
    plans = plan_experiment(exp, mfu=0.5)
    assert len(plans) == len(exp.runs)
    p, spec = plans[0], exp.runs[plans[0].run_id]
    assert p.tokens == spec.train.total_steps * spec.train.tokens_per_step
    assert p.gpu_hours == pytest.approx(p.flops / (0.5 * 989e12) / 3600)
    assert "total:" in format_plan(plans, "H100 SXM", 0.5, 80e9)
    with pytest.raises(ValueError, match="mfu"):
        plan_experiment(exp, mfu=0)


# Runs that do not fit 80 GB even with full checkpointing, by the estimate: none. (Before AttnRes's
# checkpoint units took in the pre-norms, Full and Block AttnRes at L = 70 and micro-batch 16 did
# not: the norms' fp32 inputs and outputs stayed saved outside the units, 22 GiB. Kept as a
# table so that any run that stops fitting fails this test by name.)
NOT_FITTING = {"400m": set(), "1p6b": set()}


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["400m", "1p6b"])
def test_gpu_presets_fit_80gb_with_the_checkpointing_auto_picks(preset):
    """`depthbench plan` on the GPU presets: each run's mode is the least that fits 80 GB and the
    deepest shape needs checkpointing; every run fits with it but NOT_FITTING. The 400m preset is
    planned at its widest and deepest shapes (memory grows with depth at a fixed budget; the
    full grid takes minutes to trace), the 1p6b preset whole."""
    from depthbench.grid.config import expand_grid
    from depthbench.spec.schema import load_config

    config = load_config(f"config/presets/{preset}.yaml")
    if preset == "400m":
        config["shapes"] = [config["shapes"][0], config["shapes"][-1]]
        config["learning_rates"] = config["learning_rates"][:1]
    exp = expand_grid(config)
    plans = plan_experiment(exp, gpu_memory=80e9)
    assert len(plans) == len(exp.runs)
    for p in plans:
        model = exp.runs[p.run_id].model
        assert p.fits == ((model.arch, model.n_layer) not in NOT_FITTING[preset]), (
            p.run_id,
            p.memory_checkpointed,
        )
        assert not p.fits or p.memory_auto <= 80e9, (p.run_id, p.memory_auto)
        assert (p.checkpointing != "none") == p.needs_checkpointing == (p.memory > 80e9), p.run_id
        assert p.memory_checkpointed <= p.memory_auto * (
            1 + 1e-12
        )  # full checkpointing is the least memory
    deepest = max(spec.model.n_layer for spec in exp.runs.values())
    assert all(p.needs_checkpointing for p in plans if exp.runs[p.run_id].model.n_layer == deepest)
    text = format_plan(plans, "H100 SXM", 0.4, 80e9)
    assert (
        f"{len(NOT_FITTING[preset]) * len(config['learning_rates'])} do not fit even with it"
        in text
    )
