"""The bytes one forward pass saves for backward, per checkpointing unit, traced on any device.

Activations are not a formula per architecture: each architecture saves what its own code saves
(HC's n streams, AttnRes's source list, MoDA's depth keys and its T x S scores), and a formula
kept next to eleven modules would drift from them. Instead `trace_activations` runs one forward
under `torch.autograd.graph.saved_tensors_hooks`: the bytes autograd keeps for backward are
counted once per storage, parameters excluded (they are the weights). The memory estimate
(depthbench.train.memory) runs it on the meta device (no memory, no arithmetic). Buffers that an
autograd.Function holds on its ctx instead of saving (MoDA's depth K/V buffer, AttnRes's source
buffer: later layers write into them in place) are announced by the models through
`depthbench.models.layers.held_for_backward` and counted as saved outside every unit
(checkpointing does not free them). The tensors whose values they copy are not: the buffers
reference them weakly (MoDA) or are not kept themselves (AttnRes: its Function keeps a view).

On meta the trace follows a target device (`device`, "cuda" unless told): its bf16 autocast is
replayed (depthbench.train.meta_autocast) and installed as the replay that the models' autocast
questions are answered from (depthbench.models.precision); MoE experts take that device's path
(depthbench.models.moe: grouped products on the CPU and for bf16 on CUDA, Hopper or newer;
every expert on every token for fp32 on CUDA, E/k times the experts' saved bytes). Kernels
that cannot take a meta tensor (the C++ and Triton kernels of HC/mHC) leave the modules'
definitions to run (depthbench.kernels.swap). Nothing of this outlives the trace.

Activation checkpointing (depthbench.train.parallelize) acts on the architecture's units
(`checkpoint_units`: the blocks, or attnres's pre-normed sublayers), so the trace attributes each
saved storage to the units that save it and records the storages entering each unit (its inputs,
MoDA's depth keys included). A checkpointed unit keeps only its inputs and recomputes one unit at
a time in backward: saved = every storage still saved by a non-checkpointed unit or outside the
units (embedding, final norm, head, loss, attnres's depth mixing and source norms) + the inputs
of the checkpointed units (each storage once) + the largest checkpointed unit's own saved bytes
(its recomputation).
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack

import torch

from depthbench.models.precision import replaying
from depthbench.models.layers import HELD_LISTENERS
from depthbench.train.meta_autocast import MetaAutocast


def _tensors(obj, out: list) -> list:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _tensors(getattr(obj, f.name), out)
    elif hasattr(obj, "__iter__") and not isinstance(
        obj, (str, bytes, torch.nn.Module)
    ):  # MoDA's DepthKeys
        for o in obj:
            _tensors(o, out)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _key(t: torch.Tensor):
    """One storage: its address on real devices; meta tensors have none, a view's base stands in."""
    if t.device.type != "meta":
        return t.untyped_storage().data_ptr()
    return id(t._base if t._base is not None else t)


@dataclasses.dataclass
class ActivationTrace:
    saved: dict  # storage key -> (bytes, set of saving units; -1 outside every unit)
    unit_saved: list[int]  # bytes saved inside each unit
    unit_inputs: list[dict]  # per unit: storage key -> bytes of the floating tensors entering it
    # storage key -> (bytes, gradient copies: layers.held_for_backward), held on a ctx
    held: dict = dataclasses.field(default_factory=dict)
    # per unit: the parameters of the modules it runs (a parameter run by several units counts
    # in the last: backward reaches it first), elements
    unit_params: list[int] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        """Bytes saved for backward by one micro-batch, no checkpointing."""
        return sum(b for b, _ in self.saved.values())

    @property
    def per_block(self) -> list[int]:
        return self.unit_saved

    @property
    def outside(self) -> int:
        return sum(b for b, owners in self.saved.values() if -1 in owners)

    def retained(self, recompute: list[bool]) -> int:
        """Bytes held after the forward when the units marked in `recompute` are checkpointed."""
        kept = {
            k: b
            for k, (b, owners) in self.saved.items()
            if any(o < 0 or not recompute[o] for o in owners)
        }
        for inputs, on in zip(self.unit_inputs, recompute):
            if on:
                for k, b in inputs.items():
                    kept.setdefault(k, b)
        return sum(kept.values())

    def saved_with(self, recompute: list[bool]) -> int:
        """Peak saved bytes in backward: retained + the largest recomputed unit's saved bytes."""
        return self.retained(recompute) + max(
            [b for b, on in zip(self.unit_saved, recompute) if on], default=0
        )

    @property
    def checkpointed(self) -> int:
        return self.saved_with([True] * len(self.unit_saved))


def trace_activations(
    model: torch.nn.Module, idx: torch.Tensor, bf16: bool, device: str = "cuda"
) -> ActivationTrace:
    """Saved-for-backward bytes of one forward of `model` on `idx` (any device, meta included); on
    meta, `device` is the device whose autocast and MoE paths the trace follows."""
    param_ids = {id(p) for p in model.parameters()}
    param_ptrs = {p.data_ptr() for p in model.parameters()} if idx.device.type != "meta" else set()
    saved: dict = {}
    keep: list = []  # holds every saved tensor during the pass, so that ids are not reused
    current: list[int] = [-1]
    units = list(model.checkpoint_units())
    unit_saved = [0] * len(units)
    inputs: list[dict] = [{} for _ in units]

    def pack(t):
        base = t._base if t._base is not None else t
        key = _key(t)
        if id(base) in param_ids or (t.device.type != "meta" and key in param_ptrs):
            return t
        if key not in saved:
            saved[key] = (_nbytes(t), set())
            keep.append(base)
        if current[0] not in saved[key][1]:
            saved[key][1].add(current[0])
            if current[0] >= 0:
                unit_saved[current[0]] += _nbytes(t)
        return t

    held_bytes: dict = {}

    def held(t, gradient_copies):  # kept until backward whatever is checkpointed (module docstring)
        key = _key(t)
        if key not in saved:
            saved[key] = (_nbytes(t), set())
            keep.append(t)
        saved[key][1].add(-1)
        held_bytes[key] = (_nbytes(t), gradient_copies)

    param_unit: dict[int, tuple[int, int]] = {}  # id(parameter) -> (unit, elements)

    def claim(module: torch.nn.Module) -> None:
        for p in module.parameters():
            param_unit[id(p)] = (current[0], p.numel())

    def run_in_unit(module, _args):  # every module called inside a unit (units may not own them)
        if current[0] >= 0:
            claim(module)

    hooks, depth = [], [0]
    for i, unit in enumerate(units):
        # Every submodule of unit i counts towards unit i. The tensors entering the unit are its
        # inputs (all of them: a unit may be called more than once).
        def pre(module, args, i=i):
            if depth[0] == 0:
                current[0] = i
                claim(module)
                for t in _tensors(args, []):
                    if t.is_floating_point() and id(t) not in param_ids:
                        inputs[i].setdefault(_key(t), _nbytes(t))
                        keep.append(t)
            depth[0] += 1

        def post(*_):
            depth[0] -= 1
            if depth[0] == 0:
                current[0] = -1

        for module in unit.modules():
            hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(run_in_unit))
    HELD_LISTENERS.append(held)
    try:
        with ExitStack() as regions:
            regions.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            if idx.device.type == "meta":
                mode = regions.enter_context(MetaAutocast(bf16, device))
                regions.enter_context(replaying(mode.state))
            out = model(idx, targets=idx)
            del out
    finally:
        HELD_LISTENERS.remove(held)
        for h in hooks:
            h.remove()
    unit_params = [0] * len(units)
    for owner, elements in param_unit.values():
        unit_params[owner] += elements
    return ActivationTrace(saved, unit_saved, inputs, held_bytes, unit_params)
