"""A Trainer's state to and from its checkpoints (depthbench.train.checkpoint).

Tensors (through DCP, each rank its own part): the model and the optimizer's per-parameter state,
as torch.distributed.checkpoint.state_dict's `get_state_dict` gives them: keyed by parameter
name, plain tensors for one rank or DDP, DTensor shards under FSDP2; DCP reshards them on load,
so a run resumes with any number of ranks and either strategy.
Per rank (safetensors): the CPU and CUDA RNG states.
JSON (`state.json`'s meta): step, schedule position, data position (samples consumed), wall time,
last validation loss, world size and strategy, and the optimizer's hyperparameters
(`param_groups`; non-tensor values, which DCP could only store as pickles).
"""

from __future__ import annotations

import sys

import torch

from depthbench.util.errors import CheckpointError


def snapshot(trainer, blocking: bool = False) -> None:
    """Checkpoint the trainer's current step on every rank; asynchronous unless `blocking`
    (then complete on return). A step already saved by this process is only waited for."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ck, step, tc = trainer.checkpointer, trainer.step, trainer.tc
    if ck.last_step != step:
        model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer)
        meta = {
            "schedule": {
                "step": step,
                "total_steps": tc.total_steps,
                "warmup_steps": tc.warmup_steps,
            },
            "data_position": {"samples_consumed": step * tc.global_batch_size},
            "wall_seconds": trainer.wall_seconds(),
            "last_val": trainer.last_val,
            "strategy": trainer.ctx.strategy,
            "param_groups": optim_state["param_groups"],
        }
        ck.save(
            step,
            trainer.spec.run_id,
            {"model": model_state, "optim": optim_state["state"]},
            meta,
            _rng_states(trainer.device),
            blocking=blocking,
        )
    if blocking:
        ck.wait()


def restore(trainer) -> bool:
    """Load the run's latest checkpoint, if any: weights, optimizer, RNG, step, clock."""
    if not trainer.checkpointer.has_checkpoints():
        # a fresh run: return before DCP is imported (about a second of every workflow job) and
        # before get_state_dict would fill the optimizer's state
        return False
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    # the target layout of this rank (initialises an empty optimizer state with a zero-lr step)
    fresh_optimizer = not trainer.optimizer.state
    model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer)
    template = {"model": model_state, "optim": optim_state["state"]}
    found = trainer.checkpointer.load_latest(trainer.spec.run_id, template)
    if found is None:
        if fresh_optimizer:
            # get_state_dict filled the empty AdamW state by a zero-gradient, lr-0 step, whose
            # step count (1) would shift every bias correction (1 - beta^t) of the run by one
            trainer.optimizer.state.clear()
        return False
    groups = _param_groups(found.meta["param_groups"], optim_state["param_groups"], found.path)
    set_state_dict(
        trainer.model,
        trainer.optimizer,
        model_state_dict=template["model"],
        optim_state_dict={"state": template["optim"], "param_groups": groups},
    )
    rng = found.rank_tensors
    torch.set_rng_state(rng["torch"])
    if trainer.device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], trainer.device)
    trainer.step = trainer.start_step = found.step
    trainer.wall_before = found.meta["wall_seconds"]
    trainer.last_val = found.meta.get("last_val", float("nan"))
    trainer.checkpointer.last_step = found.step
    ctx = trainer.ctx
    print(
        f"[{trainer.spec.run_id}] rank {ctx.rank}/{ctx.world_size} resumed from step {found.step} "
        f"(saved by {found.world_size} rank(s), {found.meta.get('strategy')})",
        file=sys.stderr,
    )
    return True


def _rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    states = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def _param_groups(saved: list[dict], current: list[dict], path) -> list[dict]:
    """The saved hyperparameters in the current groups' types (JSON has no tuples: AdamW's
    betas come back as lists); the groups must hold the same parameters."""
    if [g["params"] for g in saved] != [g["params"] for g in current]:
        raise CheckpointError(
            f"{path}: the optimizer's parameter groups differ from this run's (another model?)"
        )
    return [
        {k: tuple(v) if isinstance(cur.get(k), tuple) else v for k, v in g.items()}
        for g, cur in zip(saved, current)
    ]
