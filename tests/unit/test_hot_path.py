"""The training hot path (issue 23, item 5): no host reads on steps that log nothing, bit-identical
results to the loop that read the loss every micro-batch, the deferred divergence check, and
`device_id` in `init_process_group`."""

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from depthbench.train import distributed, hooks
from depthbench.train.trainer import STATUS_DIVERGED, STATUS_OK, StepStats, Trainer

TIMING = ("tokens_per_s", "mfu", "mfu_measured")


def _spec(tiny_data, steps, **train_kw):
    _, exp, _ = tiny_data
    spec = copy.deepcopy(next(iter(exp.runs.values())))
    spec.train.total_steps = steps
    for k, v in train_kw.items():
        setattr(spec.train, k, v)
    return spec


def _train(spec, data_dir, root):
    from depthbench.train.recipe import RunPaths
    from depthbench.train.loop import train

    summary = train(spec, data_dir, RunPaths(root / "run", root / "work"), progress=False)
    lines = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    return (
        summary,
        [{k: v for k, v in r.items() if k not in TIMING} for r in lines],
        load_file(root / "run" / "model.safetensors"),
    )


class ReadCounter:
    """Counts host reads of tensor values (`.item`, `.tolist`, `float()`/`int()`/`bool()`,
    `.nonzero`) by the step they happen in. The optimizer's own reads are left out: torch keeps
    AdamW's step counters on the host (non-capturable), so reading them is no device sync."""

    NAMES = ("item", "tolist", "__float__", "__int__", "__bool__", "nonzero")

    def __init__(self, monkeypatch):
        self.step, self.reads = None, {}
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name), name))
        original = Trainer._one_step

        def one_step(trainer):
            self.step = trainer.step + 1  # the step number after this update, as in the logs
            try:
                return original(trainer)
            finally:
                self.step = None

        monkeypatch.setattr(Trainer, "_one_step", one_step)

    def _wrap(self, fn, name):
        import sys

        def wrapped(t, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if self.step is not None and f"torch{os.sep}optim" not in caller:
                self.reads.setdefault(self.step, []).append(name)
            return fn(t, *args, **kwargs)

        return wrapped


@pytest.mark.parametrize("moe", [False, True])
def test_steps_that_log_nothing_read_no_tensor_on_the_host(tiny_data, tmp_path, monkeypatch, moe):
    spec = _spec(tiny_data, 8, log_every=4, eval_every=8, checkpoint_every=100)
    if moe:
        spec.model.moe = {"n_experts": 4, "top_k": 2}
    counter = ReadCounter(monkeypatch)
    summary, _, _ = _train(spec, tiny_data[2], tmp_path)
    assert summary["status"] == "ok"
    # step 4 logs (and checks divergence), step 8 logs and evaluates; nothing else reads
    assert set(counter.reads) == {4, 8}, counter.reads
    assert counter.reads[4].count("tolist") == 2  # train metrics once, divergence flag once


def _old_forward_backward(self):
    """The loop before issue 23, as the reference: `.item()` per micro-batch and host floats."""
    batches, tc = self.batches, self.tc
    loss_sum = 0.0
    for micro in range(batches.accum_steps):
        x, y = batches.get(self.step, micro)
        with distributed.gradient_sync(self.net, self.ctx, micro == batches.accum_steps - 1):
            with self.autocast:
                out = self.step_fn(x.to(self.device), y.to(self.device))
            objective = out.loss if out.aux_loss is None else out.loss + out.aux_loss
            (objective / batches.accum_steps).backward()
        loss_sum += out.loss.item()
    train_loss = distributed.all_reduce_mean(loss_sum / batches.accum_steps, self.ctx, self.device)
    max_norm = tc.grad_clip if tc.grad_clip is not None else float("inf")
    return train_loss, distributed.scalar(
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
    )


def test_device_side_losses_give_bit_identical_metrics_and_weights(
    tiny_data, tmp_path, monkeypatch
):
    spec = _spec(tiny_data, 6, log_every=1)
    got = _train(spec, tiny_data[2], tmp_path / "new")
    monkeypatch.setattr(Trainer, "forward_backward", _old_forward_backward)
    ref = _train(spec, tiny_data[2], tmp_path / "ref")
    assert got[1] == ref[1] and len(got[1]) == 6
    assert got[2].keys() == ref[2].keys() and all(torch.equal(got[2][k], ref[2][k]) for k in ref[2])


class FakeTrainer:
    def __init__(self):
        self.status, self.logged = STATUS_OK, []

    def log(self, record):
        self.logged.append(record)


def test_divergence_is_found_at_the_next_check_step_and_names_the_first_bad_step():
    hook = hooks.DivergenceHook(limit=10.0, every=(3,), total=9)
    t = FakeTrainer()
    stats = [
        StepStats(torch.tensor(2.0), torch.tensor(1.0), 0.1),
        StepStats(torch.tensor(11.0), torch.tensor(1.0), 0.2),
        StepStats(torch.tensor(float("nan")), torch.tensor(float("nan")), 0.3),
    ]
    hook.on_gradients(t, 0, stats[0])
    hook.on_gradients(t, 1, stats[1])  # bad (loss above the limit), but step 2 is no check step
    assert t.status == STATUS_OK and not t.logged
    hook.on_gradients(t, 2, stats[2])  # step 3: checked, the first bad step reported
    assert t.status == STATUS_DIVERGED
    assert t.logged == [
        {"step": 2, "train_loss": 11.0, "grad_norm": 1.0, "lr": 0.2, "event": "diverged"}
    ]
    clean = hooks.DivergenceHook(limit=10.0, every=(3,), total=9)
    t = FakeTrainer()
    for s in range(6):
        clean.on_gradients(t, s, stats[0])
    assert t.status == STATUS_OK and not t.logged
    late = hooks.DivergenceHook(limit=10.0, every=(3,), total=9)
    late.on_gradients(t, 3, stats[2])  # a process stopped on purpose before its check step
    late.on_fit_end(t)
    assert t.status == STATUS_DIVERGED and t.logged[0]["step"] == 4


def test_a_diverged_run_stops_at_its_check_step(tiny_data, tmp_path):
    from depthbench.grid.config import expand_grid
    from depthbench.spec.schema import load_config

    config, _, shards = tiny_data
    exp = expand_grid(load_config({**config, "learning_rates": [50.0]}))
    spec = copy.deepcopy(next(iter(exp.runs.values())))
    spec.train.total_steps, spec.train.log_every = 12, 3
    summary, lines, _ = _train(spec, shards, tmp_path)
    (event,) = [r for r in lines if r.get("event") == "diverged"]
    tc = spec.train
    checks = hooks.DivergenceHook(
        0.0, (tc.log_every, tc.eval_every, tc.checkpoint_every), tc.total_steps
    )
    # stopped before the update of a check step, at or after the first bad step
    assert summary["status"] == "diverged" and checks.check_due(summary["steps"] + 1)
    assert event["step"] <= summary["steps"] + 1 and summary["steps"] < 12


def test_init_process_group_binds_the_rank_gpu(monkeypatch):
    calls = {}
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.setdefault("set_device", i))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        distributed.dist, "init_process_group", lambda *a, **k: calls.setdefault("init", (a, k))
    )
    ctx, name = distributed.setup("ddp", "auto")
    assert name == "cuda:1" and calls["set_device"] == 1 and (ctx.rank, ctx.world_size) == (1, 2)
    assert calls["init"] == ((), {"backend": "nccl", "device_id": torch.device("cuda:1")})
    calls.clear()
    ctx, name = distributed.setup("ddp", "cpu")  # gloo on CPU: no device to bind
    assert name == "cpu" and calls["init"] == ((), {"backend": "gloo"})


# ---- MoE dispatch without host syncs, every expert in the graph ------------------------------------
def _moe(d=32, d_ff=48, k=2, experts=4):
    from depthbench.models.config import ModelConfig
    from depthbench.models.moe import MoESwiGLU

    cfg = ModelConfig(
        arch="pre_ln",
        vocab_size=64,
        d_model=d,
        n_layer=2,
        n_head=2,
        d_ff=d_ff,
        moe={"n_experts": experts, "top_k": k},
    )
    torch.manual_seed(0)
    m = MoESwiGLU(cfg)
    m.init_weights(0.1)
    return m


def _loop_moe(m, x):
    """The per-expert loop MoESwiGLU had before (a host sync per expert), as the reference."""
    import torch.nn.functional as F

    flat = x.reshape(-1, x.shape[-1])
    probs = F.softmax(m.router(flat).float(), dim=-1)
    top_p, top_e = probs.topk(m.top_k, dim=-1)
    top_p = (top_p / top_p.sum(-1, keepdim=True)).to(flat.dtype)
    out = torch.zeros_like(flat)
    for e in range(m.n_experts):
        token, slot = (top_e == e).nonzero(as_tuple=True)
        if token.numel():
            gate, up = (flat[token] @ m.w13[e]).chunk(2, dim=-1)
            out.index_add_(0, token, ((F.silu(gate) * up) @ m.w2[e]) * top_p[token, slot, None])
    fraction = torch.bincount(top_e.reshape(-1), minlength=m.n_experts).float() / top_e.numel()
    return out.view(x.shape), m.aux_loss_coef * m.n_experts * (fraction * probs.mean(0)).sum()


def _out_and_grads(m, x, g, fn):
    x = x.clone().requires_grad_()
    m.zero_grad(set_to_none=True)
    y, aux = fn(m, x)
    ((y * g).sum() + aux).backward()
    return [y.detach(), aux.detach(), x.grad] + [p.grad for p in m.parameters()]


def _new_moe(m, x):
    return m(x), m.aux_loss


@pytest.mark.parametrize(
    "d, d_ff, k, dense",
    [(32, 48, 2, False), (36, 45, 3, False), (32, 48, 1, True), (36, 45, 3, True)],
)
def test_moe_without_host_syncs_equals_the_per_expert_loop(monkeypatch, d, d_ff, k, dense):
    from depthbench.models import moe

    if dense:  # the fallback where F.grouped_mm does not serve
        monkeypatch.setattr(moe, "_grouped_mm_serves", lambda device, dtype: False)
    m = _moe(d, d_ff, k)
    x, g = torch.randn(3, 17, d), torch.randn(3, 17, d)
    ref = _out_and_grads(m, x, g, _loop_moe)
    for name in ("nonzero", "item", "tolist", "__bool__", "__int__"):
        monkeypatch.setattr(
            torch.Tensor,
            name,
            lambda *a, **kw: pytest.fail("host read in the MoE forward/backward"),
        )
    got = _out_and_grads(m, x, g, _new_moe)
    monkeypatch.undo()
    for a, b in zip(got, ref):
        assert (a - b).abs().max() <= 1e-6


@pytest.mark.parametrize("dense", [False, True])
def test_an_expert_without_tokens_gets_a_zero_gradient(monkeypatch, dense):
    from depthbench.models import moe

    if dense:
        monkeypatch.setattr(moe, "_grouped_mm_serves", lambda device, dtype: False)
    m = _moe()
    x = torch.randn(2, 9, 32) + 3.0  # every token has a large positive mean ...
    with torch.no_grad():
        m.router.weight[3] = -1.0  # ... so expert 3's router logit is always far below the others
    m(x).square().sum().backward()
    assert m.w13.grad is not None and m.w2.grad is not None
    assert torch.all(m.w13.grad[3] == 0) and torch.all(m.w2.grad[3] == 0)
    assert all(m.w13.grad[e].abs().sum() > 0 for e in range(3))


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
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks
def test_ddp_trains_moe_and_moda_ffn_kv_without_find_unused_parameters(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_ddp_worker, args=(str(tmp_path / "store"), tmp_path), nprocs=2, join=True)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert results["moe"] == "ok" and results["moda_ffn_kv"] == "ok", results
        assert results["control"].startswith("Expected to have finished reduction"), results


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


def test_moe_compiles_as_one_graph_under_bf16_autocast():
    """fullgraph=True fails on any graph break: a host read, a data-dependent shape."""
    m = _moe()
    x = torch.randn(2, 9, 32)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, ref = compiled(x), m(x)
    y.float().square().sum().backward()
    assert torch.equal(y, ref) and m.w13.grad is not None


def test_the_memory_estimate_traces_an_moe_model_on_meta():
    """The estimate's meta trace cannot run data-dependent shapes (the former `.nonzero()`); the
    dense fallback it takes there bounds the grouped path's saved activations from above."""
    from depthbench.models.config import ModelConfig
    from depthbench.models.registry import build_model
    from depthbench.train.memory import estimate_memory, trace_activations

    cfg = ModelConfig(
        arch="pre_ln",
        vocab_size=256,
        n_head=2,
        max_seq_len=32,
        n_layer=2,
        d_model=64,
        d_ff=160,
        moe={"n_experts": 4, "top_k": 2},
    )
    estimate = estimate_memory(cfg, 2, 32, bf16=False)
    torch.manual_seed(0)
    measured = trace_activations(
        build_model(cfg), torch.randint(0, 256, (2, 32)), bf16=False
    )  # real tensors: grouped path
    assert measured.total <= estimate.activations


def test_batches_go_to_a_gpu_from_pinned_memory_without_blocking(monkeypatch):
    """A copy from pageable memory would make the host wait for the queued backward."""
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: calls.append("pin") or t)
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: calls.append((a, k)) or t)
    trainer_module = __import__("depthbench.train.trainer", fromlist=["to_device"])
    trainer_module.to_device(torch.zeros(2, 3, dtype=torch.long), torch.device("cuda", 0))
    assert calls == ["pin", ((torch.device("cuda", 0),), {"non_blocking": True})]
    calls.clear()
    trainer_module.to_device(torch.zeros(2), torch.device("cpu"))
    assert calls == [((torch.device("cpu"),), {})]
