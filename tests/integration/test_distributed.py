"""Data-parallel training on CPU with gloo ranks started by submitit's local executor: the same
losses and weights as one rank at the same global batch, and resumption with another rank count."""

import dataclasses
import json

import pytest
import torch

from depthbench.launch.executors import slurm_parameters
from depthbench.launch.local import dispatch
from depthbench.train.recipe import RunPaths
from depthbench.train.loop import train
from depthbench.models.registry import PACKAGE_ARCHITECTURES
from tests.run_outputs import WEIGHT_TOLERANCE, max_weight_diff

pytestmark = pytest.mark.slow


def _spec(tiny_data, parallel="ddp"):
    _, exp, _ = tiny_data
    spec = next(iter(exp.runs.values()))
    return dataclasses.replace(
        spec,
        train=dataclasses.replace(spec.train, parallel=parallel, checkpoint_every=4, log_every=1),
    )


def _losses(run_dir):
    return {
        r["step"]: r["train_loss"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "train_loss" in r
    }


@pytest.fixture(scope="module")
def one_rank(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("one_rank")
    summary = train(
        _spec(tiny_data), tiny_data[2], RunPaths(root / "run", root / "work"), progress=False
    )
    assert summary["status"] == "ok" and summary["world_size"] == 1
    return root / "run"


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_gloo_ranks_match_one_rank(tiny_data, one_rank, tmp_path, parallel):
    spec = _spec(tiny_data, parallel)
    summary = dispatch(
        spec,
        tiny_data[2],
        tmp_path / "run",
        tmp_path / "work",
        {"backend": "local", "local_ranks": 2},
        threads=2,
    )
    assert (
        summary["status"] == "ok" and summary["world_size"] == 2 and summary["parallel"] == parallel
    )
    ref, got = _losses(one_rank), _losses(tmp_path / "run")
    assert ref.keys() == got.keys() and len(ref) == spec.train.total_steps
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-5), step
    assert max_weight_diff(one_rank, tmp_path / "run") < WEIGHT_TOLERANCE


def _interrupted_two_ranks(spec, data_dir, paths) -> None:
    """Train `spec` on 2 gloo ranks for 6 steps (asynchronous checkpoint at step 4, blocking one
    at 6 where the process stops)."""
    from depthbench.launch.jobs import TrainingJob, export_distributed_env
    from depthbench.launch.local import submit_and_wait

    class Interrupted(TrainingJob):
        def __call__(self, spec, data_dir, run_dir, work_dir, progress=True):
            from depthbench.spec.run import RunSpec

            export_distributed_env()
            return train(
                RunSpec.from_dict(spec),
                data_dir,
                RunPaths(run_dir, work_dir),
                progress=False,
                stop_after=6,
            )

    args = (spec.to_dict(), str(data_dir), str(paths.run_dir), str(paths.work_dir), False)
    out = submit_and_wait(
        Interrupted(),
        args,
        "interrupted",
        str(paths.work_dir),
        {"backend": "local", "local_ranks": 2},
    )
    assert out["status"] == "interrupted"


def _saved_by_each_rank(checkpoint, parallel: str) -> None:
    """The checkpoint was written in parts, one per rank, and says by whom."""
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["world_size"] == 2 and state["meta"]["strategy"] == parallel
    assert {
        "__0_0.distcp",
        "__1_0.distcp",
        "rank_0.safetensors",
        "rank_1.safetensors",
        ".metadata",
    } <= set(state["files"])
    parts = [(checkpoint / f"__{r}_0.distcp").stat().st_size for r in (0, 1)]
    assert min(parts) > 0.3 * max(parts), (
        parts
    )  # FSDP2 shards / DCP's split of replicated tensors: each a share


def test_checkpoint_of_two_ranks_resumes_with_one(tiny_data, one_rank, tmp_path):
    """Train 2 ranks (FSDP2, sharded) until a checkpoint is written and the job stops; resume
    with 1 rank: the loss curve continues as the uninterrupted run's."""
    from depthbench.train.checkpoint_folder import list_checkpoints

    spec = _spec(tiny_data, "fsdp")
    paths = RunPaths(tmp_path / "run", tmp_path / "work")
    _interrupted_two_ranks(spec, tiny_data[2], paths)
    assert [s for s, _ in list_checkpoints(paths.checkpoints)] == [4, 6]
    _saved_by_each_rank(list_checkpoints(paths.checkpoints)[-1][1], "fsdp")
    summary = train(
        dataclasses.replace(spec, train=dataclasses.replace(spec.train, parallel="ddp")),
        tiny_data[2],
        paths,
        progress=False,
    )
    assert summary["status"] == "ok" and summary["world_size"] == 1
    ref, got = _losses(one_rank), _losses(paths.run_dir)
    assert ref.keys() == got.keys()
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-5), step
    assert max_weight_diff(one_rank, paths.run_dir) < WEIGHT_TOLERANCE


def test_asynchronous_ddp_checkpoint_resumes_under_fsdp2(tiny_data, one_rank, tmp_path):
    """2 DDP ranks stop at step 6; the checkpoint of step 4, written asynchronously while steps 5
    and 6 trained, is the one kept: 2 FSDP2 ranks resume from it to the uninterrupted weights."""
    import shutil

    from depthbench.train.checkpoint_folder import list_checkpoints

    paths = RunPaths(tmp_path / "run", tmp_path / "work")
    _interrupted_two_ranks(_spec(tiny_data, "ddp"), tiny_data[2], paths)
    (step4, first), (_, last) = list_checkpoints(paths.checkpoints)
    _saved_by_each_rank(first, "ddp")
    shutil.rmtree(last)
    spec = _spec(tiny_data, "fsdp")
    summary = dispatch(
        spec,
        tiny_data[2],
        paths.run_dir,
        paths.work_dir,
        {"backend": "local", "local_ranks": 2},
        threads=2,
    )
    assert summary["status"] == "ok" and summary["parallel"] == "fsdp"
    log = "".join(p.read_text() for p in (paths.work_dir / "submitit").glob("*_log.err"))
    assert f"resumed from step {step4} (saved by 2 rank(s), ddp)" in log
    ref, got = _losses(one_rank), _losses(paths.run_dir)
    assert ref.keys() == got.keys()
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-5), step
    assert max_weight_diff(one_rank, paths.run_dir) < WEIGHT_TOLERANCE


def test_slurm_jobs_ask_one_task_per_gpu():
    p = slurm_parameters({"slurm": {"nodes": 2, "gpus_per_node": 8}})
    assert p["nodes"] == 2 and p["gpus_per_node"] == 8 and p["ntasks_per_node"] == 8


ALL_ARCHS = list(PACKAGE_ARCHITECTURES)  # every architecture of the package


def test_every_architecture_shards_with_fsdp2(tmp_path):
    """FSDP2 gathers a unit's parameters only inside its own forward: every architecture's units
    (DecoderLM.fsdp_units) must give the unsharded model's loss and gradients. One gloo rank in
    this process is enough to catch a parameter read outside its unit (a DTensor error)."""
    import copy

    import torch.distributed as dist

    from depthbench.models.config import ModelConfig
    from depthbench.models.registry import build_model
    from depthbench.train.distributed import shard

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        for arch in ALL_ARCHS:
            torch.manual_seed(0)
            model = build_model(
                ModelConfig(
                    arch=arch, vocab_size=64, d_model=32, n_layer=3, n_head=2, max_seq_len=16
                )
            )
            for p in model.parameters():  # away from zero-initialised queries and dynamics
                p.data.add_(0.05 * torch.randn_like(p))
            reference = copy.deepcopy(model)
            shard(model)
            idx = torch.randint(0, 64, (2, 9))
            loss = model(idx[:, :-1], idx[:, 1:]).loss
            loss.backward()
            ref_loss = reference(idx[:, :-1], idx[:, 1:]).loss
            ref_loss.backward()
            assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6), arch
            ref_grads = dict(reference.named_parameters())
            for name, p in model.named_parameters():
                torch.testing.assert_close(
                    p.grad.full_tensor(),
                    ref_grads[name].grad,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=f"{arch} {name}",
                )
    finally:
        dist.destroy_process_group()


def _task_pid(submitit_folder, rank: int) -> int | None:
    """The pid of the local job's task of global rank `rank` (submitit's runner process)."""
    from pathlib import Path

    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"submitit.core._submit" in argv
            and str(submitit_folder).encode() in argv
            and f"SUBMITIT_LOCAL_GLOBALID={rank}".encode() in env
        ):
            return int(entry.name)
    return None


def test_requeue_signal_to_one_rank_checkpoints_both_and_the_job_is_requeued(
    tiny_data, one_rank, tmp_path
):
    """SIGUSR2 reaches rank 1 only (SLURM signals each task at its own moment): both ranks stop
    after the same step and write their parts, rank 0 hands the signal to submitit, which
    requeues the job (the local executor restarts it); the restarted job resumes there."""
    import os
    import re
    import signal
    import threading
    import time

    base = _spec(tiny_data, "ddp")
    spec = dataclasses.replace(
        base, train=dataclasses.replace(base.train, checkpoint_every=1000)
    )  # only the signal's
    paths = RunPaths(tmp_path / "run", tmp_path / "work")
    sent = []

    def signal_rank_1():
        deadline = time.time() + 300
        while time.time() < deadline and not sent:
            lines = paths.metrics.read_text().splitlines() if paths.metrics.exists() else []
            pid = _task_pid(paths.work_dir / "submitit", 1)
            if len(lines) >= 2 and pid is not None:
                os.kill(pid, signal.SIGUSR2)
                sent.append(pid)
            time.sleep(0.05)

    sender = threading.Thread(target=signal_rank_1)
    sender.start()
    summary = dispatch(
        spec,
        tiny_data[2],
        paths.run_dir,
        paths.work_dir,
        {"backend": "local", "local_ranks": 2},
        threads=2,
    )
    sender.join()
    assert sent and summary["status"] == "ok"
    logs = {
        r: "".join(p.read_text() for p in (paths.work_dir / "submitit").glob(f"*_{r}_log.err"))
        for r in (0, 1)
    }
    (step,) = {int(s) for s in re.findall(r"SIGUSR2: checkpointed step (\d+)", logs[0])}
    assert "Requeued job" in logs[0] + "".join(
        p.read_text() for p in (paths.work_dir / "submitit").glob("*_0_log.out")
    )
    for r in (0, 1):
        assert f"rank {r}/2 resumed from step {step} (saved by 2 rank(s), ddp)" in logs[r]
    ref, got = _losses(one_rank), _losses(paths.run_dir)
    assert ref.keys() == got.keys()
    for s in ref:
        assert got[s] == pytest.approx(ref[s], abs=1e-5), s
    assert max_weight_diff(one_rank, paths.run_dir) < WEIGHT_TOLERANCE


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_one_process_full_state_is_dcps_full_state_dict(arch):
    """full_model_state's one-process shortcut (the module's own state dict, no DCP) gives exactly
    what DCP's get_model_state_dict(full_state_dict=True) gives: the same keys, the same values."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from depthbench.models.config import ModelConfig
    from depthbench.models.registry import build_model
    from depthbench.train.distributed import DistContext, full_model_state

    torch.manual_seed(0)
    model = build_model(
        ModelConfig(arch=arch, vocab_size=64, d_model=32, n_layer=3, n_head=2, max_seq_len=16)
    )
    ours = full_model_state(model, DistContext())
    dcp = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert list(ours) == list(dcp)
    assert all(torch.equal(ours[k], dcp[k]) for k in dcp)


FSDP_STEPS, FSDP_BATCH = 3, 4


def _stream_model(arch: str, kernels: str):
    """A small hc or mhc; `kernels`: auto (the CPU's C++ kernels swapped in) or reference."""
    from depthbench.kernels.swap import swap_in
    from depthbench.models.config import ModelConfig
    from depthbench.models.registry import build_model

    torch.manual_seed(0)
    options = {"sinkhorn_iterations": 5} if arch == "mhc" else {}
    model = build_model(
        ModelConfig(
            arch=arch,
            vocab_size=64,
            d_model=32,
            n_layer=2,
            n_head=2,
            max_seq_len=16,
            arch_options=options,
        )
    )
    for p in model.parameters():  # away from the zero-initialised dynamic weights
        p.data.add_(0.05 * torch.randn_like(p))
    return swap_in(model, "cpu", kernels)


def _sgd_steps(model, idx, full_tensor=lambda t: t):
    """FSDP_STEPS SGD steps on `idx`; per step the (full) gradients, then the (full) parameters."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    steps = []
    for _ in range(FSDP_STEPS):
        model(idx[:, :-1], idx[:, 1:]).loss.backward()
        grads = {n: full_tensor(p.grad).clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append(
            (grads, {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()})
        )
    return steps


def _fsdp_stream_worker(rank, world, store, out):
    """One gloo rank: hc and mhc sharded by FSDP2 (shard: one unit per block, then the root),
    through the CPU kernels and through the PyTorch code, trained on this rank's rows of the
    batch; every warning the forwards and backwards raise is recorded."""
    import warnings

    import torch.distributed as dist

    from depthbench.train.distributed import shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {}
    for kernels in ("auto", "reference"):
        for arch in ("hc", "mhc"):
            model = shard(_stream_model(arch, kernels))
            idx = torch.randint(0, 64, (FSDP_BATCH, 9), generator=torch.Generator().manual_seed(1))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                steps = _sgd_steps(model, idx[rank::world], full_tensor=lambda t: t.full_tensor())
            results[arch, kernels] = (steps, [str(w.message) for w in caught])
    if rank == 0:
        torch.save(results, out)
    # both ranks past their last collective before either tears gloo down (as
    # depthbench.train.distributed.teardown does): a rank that destroys its group and exits while
    # the other still holds the FSDP2 units' groups can abort in gloo's destructor (SIGABRT,
    # "terminate called without an active exception")
    del model
    dist.barrier()
    dist.destroy_process_group()


def test_hc_and_mhc_under_two_fsdp2_ranks_match_one_process_and_return_no_views(tmp_path):
    """2 gloo ranks, each half the batch, FSDP2 over hc's and mhc's blocks: every gradient and
    every parameter after each of 3 SGD steps equals one process on the whole batch to 1e-5, and
    FSDP2 never warns that a unit returned a view (an in-place op on such an output would skip
    the unit's pre-backward hook, and with it the all-gather of its parameters for backward).
    Through the CPU kernels and through the definitions."""
    import torch.multiprocessing as mp

    mp.spawn(
        _fsdp_stream_worker,
        args=(2, str(tmp_path / "store"), str(tmp_path / "out.pt")),
        nprocs=2,
        join=True,
    )
    results = torch.load(tmp_path / "out.pt", weights_only=False)
    for (arch, kernels), (steps, caught) in results.items():
        assert not [m for m in caught if "view" in m], (arch, kernels, caught)
        model = _stream_model(arch, kernels)
        idx = torch.randint(0, 64, (FSDP_BATCH, 9), generator=torch.Generator().manual_seed(1))
        reference = _sgd_steps(model, idx)
        assert len(steps) == len(reference) == FSDP_STEPS
        for step, ((grads, params), (ref_grads, ref_params)) in enumerate(zip(steps, reference)):
            assert grads.keys() == ref_grads.keys() and params.keys() == ref_params.keys()
            for name in ref_grads:
                where = f"{arch} kernels={kernels} step {step} {name}"
                torch.testing.assert_close(
                    grads[name], ref_grads[name], rtol=0, atol=1e-5, msg=where
                )
                torch.testing.assert_close(
                    params[name], ref_params[name], rtol=0, atol=1e-5, msg=where
                )
