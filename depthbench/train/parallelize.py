"""How the training step's model is wrapped: activation checkpointing, then compile, then
data parallelism, in torchtitan's order (checkpoint wrappers inside the compiled region, the
compiled region inside FSDP2's units, so that FSDP2's all-gather hooks never break a graph).

Units. Checkpointing and per-block compile act on the architecture's checkpoint units
(`DecoderLM.checkpoint_units`): the modules the trunk calls, one per layer (a block) by default,
or per sublayer (attnres: each sublayer with its pre-norm; its depth mixing runs outside them);
FSDP2 shards `DecoderLM.fsdp_units` (the blocks, or attnres's attention and FFN modules). For
attnres the FSDP2 unit therefore sits inside the checkpointed and compiled one: the
recomputation all-gathers the sublayer's parameters again (as FSDP2 expects of checkpointing),
and under `compile: block` dynamo breaks the graph at FSDP2's hooks, so the pre-norm and the
sublayer compile as separate graphs (tested equal to one rank in
tests/integration/test_parallelize_ranks.py).
A unit is wrapped by setting its instance `forward` to `run_unit`, so parameter names, state
dicts and checkpoints do not change.

`train.activation_checkpointing` (torch.utils.checkpoint, non-reentrant):
- `none`: every unit keeps its saved activations.
- `full`: every unit keeps only its inputs and recomputes its forward during backward.
- `selective`: every other unit (the 1st, 3rd, ...) is checkpointed, the rest keep their
  activations: about half the saved memory of the units for about half the recomputation.
  (Chosen over op-level selective checkpointing because the memory estimator predicts it from
  the same per-unit trace, and it is the same for every architecture.)
- `auto` (default): on CUDA, the least of none, selective, full for which the memory estimate
  (depthbench.train.memory) fits the GPU's memory with its headroom; `none` on CPU, where no
  fixed device memory is configured.
Only in training (grad enabled, no probe records): evaluation and probes run the plain forward.
The RNG state is not saved for the recomputation (`preserve_rng_state=False`): no architecture
draws random numbers in its forward (no dropout), and the saved state is 5 KB per unit.

`train.kernels`: `auto` (default) swaps in the device's fast implementations before anything
else wraps the model (depthbench.kernels.swap), `reference` trains the architectures'
definitions as written.

`train.compile`: `none`; `model` (torch.compile of the whole wrapped model, as before); `block`:
each unit's forward through one compiled function (`dynamic=False`), shared by every unit, so a
graph compiled for layer 1 serves every layer whose guards it passes (position-bound constants
such as LNS's 1/sqrt(l) are buffers, i.e. graph inputs, not constants). dynamo's state is reset
first, so a process that builds many models never reaches the recompile limit; the limit is
raised to the number of units plus 8 because MoDA's depth-key count differs at every layer (one
graph per layer there). Legacy booleans: false = none, true = model.

FSDP2 (`train.parallel: fsdp`): `fully_shard` per unit and then the root with
`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)` when training in bf16 on
CUDA; otherwise float32 parameters (CPU tests compare with one rank exactly).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from depthbench.kernels.swap import swap_in
from depthbench.train.memory import recompute_mask
from depthbench.util.errors import ConfigError

CHECKPOINTING = ("auto", "none", "full", "selective")
COMPILE = ("none", "model", "block")


def compile_mode(value) -> str:
    """`train.compile` as one of COMPILE (legacy booleans mapped)."""
    if isinstance(value, bool):
        return "model" if value else "none"
    if value not in COMPILE:
        raise ConfigError("train.compile", f"{value!r}; valid: {list(COMPILE)} (or true/false)")
    return value


def checkpointed_units(mode: str, n_units: int) -> list[bool]:
    """Which units a checkpointing mode recomputes (see the module docstring)."""
    if mode not in CHECKPOINTING or mode == "auto":
        raise ConfigError(
            "train.activation_checkpointing",
            f"{mode!r}; valid: {list(CHECKPOINTING[1:])} (auto resolved first)",
        )
    return recompute_mask(mode, n_units)


def resolve_checkpointing(
    mode: str, model_cfg, tc, device: torch.device, world: int, bf16: bool
) -> str:
    """`auto` -> none / selective / full from the memory estimate and the GPU's memory."""
    if mode not in CHECKPOINTING:
        raise ConfigError(
            "train.activation_checkpointing", f"{mode!r}; valid: {list(CHECKPOINTING)}"
        )
    if mode != "auto":
        return mode
    if device.type != "cuda":
        return "none"
    from depthbench.train.memory import estimate_memory

    est = estimate_memory(
        model_cfg,
        tc.micro_batch_size,
        tc.seq_len,
        bf16=bf16,
        world=world,
        fsdp=tc.parallel == "fsdp",
        loss_chunk_tokens=tc.loss_chunk_tokens,
        accumulating=tc.micro_batches_per_rank(world) > 1,
    )
    return est.checkpointing_for(torch.cuda.get_device_properties(device).total_memory)


def _fork_accumulators(args: tuple) -> dict[int, object]:
    """Arguments a unit appends to (MoDA's DepthKeys: `fork`, `append`, iteration), by position."""
    return {i: a for i, a in enumerate(args) if hasattr(a, "fork") and hasattr(a, "append")}


def _checkpointed_call(unit: nn.Module, args: tuple, kwargs: dict):
    """`unit`'s forward under non-reentrant checkpointing. A unit that appends to an argument
    (MoDA's depth keys) would find the later layers' keys there when recomputed in backward and
    compute something else; it runs on a fork taken before the call instead, every time, and
    what it appended in the forward is appended to the real argument afterwards."""
    forward = type(unit).forward
    accumulators = _fork_accumulators(args)
    if not accumulators:
        return checkpoint(
            forward, unit, *args, use_reentrant=False, preserve_rng_state=False, **kwargs
        )
    before = {i: a.fork() for i, a in accumulators.items()}
    # the recomputation holds this list, not `args`: the real accumulator would keep every later
    # layer's additions alive until backward
    template = [None if i in accumulators else a for i, a in enumerate(args)]

    def body():
        call = list(template)
        for i, snapshot in before.items():
            call[i] = snapshot.fork()
        out = forward(unit, *call, **kwargs)
        return out, {i: list(call[i])[len(snapshot) :] for i, snapshot in before.items()}

    out, added = checkpoint(body, use_reentrant=False, preserve_rng_state=False)
    for i, items in added.items():
        for item in items:
            accumulators[i].append(item)
    return out


def run_unit(unit: nn.Module, recompute: bool, *args, **kwargs):
    """The forward of one unit: checkpointed when `recompute` and training (grad enabled, no probe
    records requested through `internals`), else the class's own forward."""
    records = len(args) > 2 and args[2] is not None or kwargs.get("internals") is not None
    if recompute and torch.is_grad_enabled() and not records:
        return _checkpointed_call(unit, args, kwargs)
    return type(unit).forward(unit, *args, **kwargs)


class _UnitForward:
    """The instance `forward` of a wrapped unit: `fn(unit, recompute, ...)` (run_unit, or its
    compiled version). A class rather than a closure so that `unit` is an argument of the compiled
    function (every unit shares its cache) and the unit does not hold itself in a closure cell."""

    def __init__(self, fn, unit: nn.Module, recompute: bool):
        self.fn, self.recompute = fn, recompute
        self.unit_ref = unit

    def __call__(self, *args, **kwargs):
        return self.fn(self.unit_ref, self.recompute, *args, **kwargs)


def wrap_units(
    model: nn.Module,
    checkpointing: str,
    compile: str = "none",
    backend: str = "inductor",
    fullgraph: bool = False,
) -> list[nn.Module]:
    """Activation checkpointing and per-block compile on the model's units, in place; returns
    them. `fullgraph`: a graph break in a unit is an error (the tests hold every architecture
    to it; training leaves it off, since FSDP2's hooks inside AttnRes's units break graphs)."""
    units = list(model.checkpoint_units())
    recompute = checkpointed_units(checkpointing, len(units))
    fn = run_unit
    if compile_mode(compile) == "block":
        torch._dynamo.reset()  # a process that compiles many models starts each from a clean cache
        limit = len(units) + 8  # MoDA: one graph per depth-key count
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        fn = torch.compile(run_unit, dynamic=False, backend=backend, fullgraph=fullgraph)
    if fn is run_unit and not any(recompute):
        return units
    for unit, on in zip(units, recompute):
        unit.forward = _UnitForward(fn, unit, on)
    return units


def parallelize(
    model: nn.Module, tc, ctx, device: torch.device, dtype: torch.dtype, backend: str = "inductor"
):
    """(net, step_fn): the module the step's gradient sync acts on and the callable it runs.
    Order: the device's implementations (depthbench.kernels.swap, `train.kernels`),
    checkpointing, per-block compile, then DDP / FSDP2 / nothing, then whole-model compile."""
    from depthbench.train import distributed

    swap_in(model, device, tc.kernels)
    mode = resolve_checkpointing(
        tc.activation_checkpointing, model.cfg, tc, device, ctx.world_size, dtype == torch.bfloat16
    )
    compile = compile_mode(tc.compile)
    wrap_units(model, mode, compile, backend)
    net = distributed.data_parallel(model, ctx, device, dtype)
    step_fn = torch.compile(net, backend=backend) if compile == "model" else net
    return net, step_fn, mode
