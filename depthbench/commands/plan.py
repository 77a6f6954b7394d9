"""`depthbench plan CONFIG`: what a sweep costs before it is launched.

Per run: training FLOPs (depthbench.models.cost's analytic count, 3 x forward per token, times the
run's tokens), GPU-hours at a stated MFU on a stated GPU (peak dense bf16 FLOP/s), scaled by the
architecture's step time relative to pre_ln where a GPU record measured it
(depthbench.commands.step_records: measured, else assumed), per-GPU memory
at the configured micro-batch without and with full activation checkpointing
(depthbench.train.memory), the checkpointing mode `train.activation_checkpointing: auto` picks
(the least of none / selective / full that fits; depthbench.train.parallelize), its memory,
whether the run fits with it, and disk. Disk per run = one training checkpoint (fp32 weights +
AdamW's two fp32 moments: 12 bytes per parameter; the step counter, RNG states and the loop state
are negligible) + the final fp32 safetensors weights (4 bytes per parameter); logs and probe
outputs are small and not counted.

For the sweep: the tokenization's time (`tokenization_estimate`), tokens to tokenize / (the
tokenizer's throughput per process x corpus.pieces, the pieces running at once). The tokens are
what is known before anything is read: one epoch of the longest run (its training tokens) plus
the validation share. The whole corpus is tokenized, so a corpus larger than that takes longer
in proportion (the presets' comments give their corpora's sizes), one that training repeats less.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from depthbench.commands.step_records import StepRecord
from depthbench.grid.extend import cell_of
from depthbench.launch.executors import ranks_per_run
from depthbench.models.cost import analytic_cost
from depthbench.train.memory import HEADROOM, estimate_memory

DEFAULT_GPU = "H100 SXM"
DEFAULT_PEAK = 989e12  # H100 SXM dense bf16 FLOP/s
DEFAULT_GPU_MEMORY = 80e9
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights + two fp32 AdamW moments
WEIGHTS_BYTES_PER_PARAM = 4
# Tokens per second of one tokenize process (one core), with the GPT-NeoX-OLMo tokenizer (the GPU
# presets') on the wiki corpus: docs/benchmarks.md#data-checkpoints-export-slurm
TOKENIZE_TOKENS_PER_S = 2.0e5


@dataclass
class RunPlan:
    run_id: str
    tokens: int
    flops: float
    gpu_hours: float
    memory: float  # bytes per GPU, no activation checkpointing (headroom included)
    memory_checkpointed: float
    needs_checkpointing: bool
    fits: bool
    disk: float
    checkpointing: str = "none"  # what `auto` picks: none, selective or full
    memory_auto: float = 0.0  # bytes per GPU with that mode (headroom included)
    arch: str = ""
    step_factor: float | None = None  # measured step time relative to pre_ln (None: assumed)


@dataclass
class TokenizationEstimate:
    tokens: float  # one epoch of the longest run: its training tokens / (1 - val_fraction)
    training_tokens: int  # the longest run's
    val_fraction: float
    pieces: int
    seconds: float  # tokens / (TOKENIZE_TOKENS_PER_S x pieces)


def tokenization_estimate(exp) -> TokenizationEstimate | None:
    """The tokenization's time for `exp` (see the module docstring); None for pre-tokenized
    shards."""
    corpus = exp.config["corpus"]
    if corpus["source"] == "shards":
        return None
    training = max(
        (s.train.total_steps * s.train.tokens_per_step for s in exp.runs.values()), default=0
    )
    val_fraction = corpus.get("val_fraction", 0.05)
    tokens = training / (1 - val_fraction)
    pieces = corpus.get("pieces", 1)
    return TokenizationEstimate(
        tokens, training, val_fraction, pieces, tokens / (TOKENIZE_TOKENS_PER_S * pieces)
    )


def format_tokenization(t: TokenizationEstimate) -> str:
    hours = t.seconds / 3600
    how = (
        (
            f"in {t.pieces} parallel pieces: {hours:,.1f} h "
            f"({hours * t.pieces:,.1f} h in one job), plus one indexing pass (tokenize_index)"
        )
        if t.pieces > 1
        else f"in one job: {hours:,.1f} h"
    )
    return (
        f"tokenization: {t.tokens:.3e} tokens (one epoch of the longest run, "
        f"{t.training_tokens:.3e} training tokens, with the {t.val_fraction:g} validation share; "
        "the whole corpus is tokenized, so a larger corpus takes longer) "
        f"at {TOKENIZE_TOKENS_PER_S:,.0f} tokens/s per process (measured: docs/benchmarks.md) "
        f"{how}"
    )


class SweepPlan(list):
    """The RunPlans of a sweep, in run order, and its tokenization estimate (`tokenization`)."""

    def __init__(self, plans=(), tokenization: TokenizationEstimate | None = None):
        super().__init__(plans)
        self.tokenization = tokenization
        # seeds_at_best_lr: one cell's replicates each, standing for those the sweep will choose
        self.replicates: list[RunPlan] = []
        # lr_sweep.max_extensions: one side's extensions of each cell, the most that can train
        self.extensions: list[RunPlan] = []


def plan_experiment(
    exp,
    mfu: float = 0.4,
    peak: float = DEFAULT_PEAK,
    gpu_memory: float = DEFAULT_GPU_MEMORY,
    record: StepRecord | None = None,
) -> SweepPlan:
    """One RunPlan per run; memory traces are shared by runs of the same model and batch. With
    a `record`, each run is priced by its architecture's measured step time relative to pre_ln
    (depthbench.commands.step_records)."""
    if not 0 < mfu <= 1:
        raise ValueError(f"--mfu {mfu}: must be in (0, 1]")
    world = ranks_per_run(exp.config["launcher"])
    cache: dict = {}

    def run_plan(run_id, spec) -> RunPlan:
        tc = spec.train
        tokens = tc.total_steps * tc.tokens_per_step
        key = json.dumps(
            [
                spec.model.to_dict(),
                tc.micro_batch_size,
                tc.seq_len,
                tc.loss_chunk_tokens,
                tc.global_batch_size,
                tc.parallel,
            ],
            sort_keys=True,
            default=str,
        )
        if key not in cache:
            cost = analytic_cost(spec.model, tc.seq_len)
            est = estimate_memory(
                spec.model,
                tc.micro_batch_size,
                tc.seq_len,
                bf16=True,
                world=world,
                fsdp=tc.parallel == "fsdp",
                loss_chunk_tokens=tc.loss_chunk_tokens,
                accumulating=tc.micro_batches_per_rank(world) > 1,
            )
            factor = record.relative_step_time(spec.arch, spec.model.n_layer) if record else None
            base = (  # pre_ln's work at this shape, which the measured factor scales
                analytic_cost(
                    dataclasses.replace(spec.model, arch="pre_ln", arch_options={}), tc.seq_len
                )["train_flops_per_token"]
                if factor is not None
                else cost["train_flops_per_token"]
            )
            cache[key] = (cost, est, factor, base * (factor or 1.0))
        cost, est, factor, priced_flops_per_token = cache[key]
        flops = cost["train_flops_per_token"] * tokens
        params = cost["params_total"]
        return RunPlan(
            run_id=run_id,
            tokens=tokens,
            flops=flops,
            # GPU-hours: the (priced) work / the per-GPU rate at the stated MFU
            gpu_hours=priced_flops_per_token * tokens / (mfu * peak) / 3600.0,
            memory=est.total(False) * (1 + HEADROOM),
            memory_checkpointed=est.total(True) * (1 + HEADROOM),
            needs_checkpointing=est.needs_checkpointing(gpu_memory),
            fits=est.fits(gpu_memory),
            disk=params * (CHECKPOINT_BYTES_PER_PARAM + WEIGHTS_BYTES_PER_PARAM),
            checkpointing=est.checkpointing_for(gpu_memory),
            memory_auto=est.total(est.checkpointing_for(gpu_memory)) * (1 + HEADROOM),
            arch=spec.arch,
            step_factor=factor,
        )

    plans = SweepPlan(
        [run_plan(run_id, spec) for run_id, spec in exp.runs.items()],
        tokenization=tokenization_estimate(exp),
    )
    # seeds_at_best_lr: one cell's replicates cost the same at any of its LRs, so those of the
    # cell's first LR stand for the ones the sweep will choose
    cells: dict[str, dict] = {}
    for sweep_id, replicas in exp.replicates.items():
        spec = exp.candidate_runs[sweep_id]
        cell = json.dumps(
            [spec.arch, spec.model.to_dict(), spec.knobs], sort_keys=True, default=str
        )
        cells.setdefault(cell, replicas)
    plans.replicates = [
        run_plan(rid, spec) for reps in cells.values() for rid, spec in reps.items()
    ]
    # an extension costs what its cell's runs cost; a cell extends on one side only
    top = {}
    for spec in exp.runs.values():
        top[cell_of(spec)] = max(top.get(cell_of(spec), 0.0), spec.lr)
    plans.extensions = [
        run_plan(rid, spec) for rid, spec in exp.extensions.items() if spec.lr > top[cell_of(spec)]
    ]
    return plans


def format_pricing(plans: list[RunPlan], record: StepRecord | None, mfu: float) -> list[str]:
    """Per architecture: its runs' GPU-hours and whether its step time is measured (the
    record's relative step time, with the depths measured) or assumed (its FLOPs at the MFU)."""
    lines = [
        f"GPU-hours by architecture (pre_ln at MFU {mfu:g}, assumed; "
        + (
            f"step time relative to pre_ln measured, {record.describe()}):"
            if record
            else "no GPU record: every architecture at its FLOPs, assumed):"
        )
    ]
    for arch in dict.fromkeys(p.arch for p in plans):
        runs = [p for p in plans if p.arch == arch]
        hours = sum(p.gpu_hours for p in runs)
        factors = sorted({round(p.step_factor, 2) for p in runs if p.step_factor is not None})
        if arch == "pre_ln":
            how = "the reference: its FLOPs at the MFU"
        elif factors and record is not None:
            depths = ", ".join(str(L) for L in record.depths(arch))
            how = (
                f"measured {factors[0]:g}-{factors[-1]:g}x pre_ln"
                if len(factors) > 1
                else f"measured {factors[0]:g}x pre_ln"
            ) + f" (L = {depths})"
        else:
            how = "assumed: its FLOPs at the MFU"
        lines.append(f"  {arch:<14} {len(runs):>4} runs {hours:>10,.0f} GPU-h  {how}")
    return lines


def format_plan(plans: list[RunPlan], gpu: str, mfu: float, gpu_memory: float, record=None) -> str:
    gib = 2**30
    lines = [
        f"{'run':<44} {'tokens':>15} {'FLOPs':>10} {'GPU-h':>8} {'mem GiB':>8} "
        f"{'ckpt GiB':>8} {'AC':>9} {'AC GiB':>8} {'fits':>4} {'disk GiB':>8}"
    ]
    for p in plans:
        lines.append(
            f"{p.run_id:<44} {p.tokens:>15,} {p.flops:>10.3e} {p.gpu_hours:>8.1f} "
            f"{p.memory / gib:>8.1f} "
            f"{p.memory_checkpointed / gib:>8.1f} {p.checkpointing:>9} {p.memory_auto / gib:>8.1f} "
            f"{'yes' if p.fits else 'NO':>4} {p.disk / gib:>8.2f}"
        )
    total_h = sum(p.gpu_hours for p in plans)
    lines.append(
        f"total: {len(plans)} runs, {sum(p.tokens for p in plans):,} tokens, "
        f"{sum(p.flops for p in plans):.3e} FLOPs, "
        f"{total_h:,.0f} GPU-hours on {gpu} at MFU {mfu:g}, "
        f"disk {sum(p.disk for p in plans) / 1e12:.2f} TB; "
        f"{sum(p.needs_checkpointing for p in plans)} runs need activation checkpointing "
        f"on a {gpu_memory / 1e9:g} GB GPU "
        f"({sum(p.checkpointing == 'selective' for p in plans)} selective, "
        f"{sum(p.checkpointing == 'full' for p in plans)} full), "
        f"{sum(not p.fits for p in plans)} do not fit even with it "
        f"(memory includes {HEADROOM:.0%} headroom; "
        "AC = the mode train.activation_checkpointing: auto picks, AC GiB its memory)"
    )
    lines += format_pricing(plans, record, mfu)
    replicates = getattr(plans, "replicates", [])
    if replicates:
        lines.append(
            f"after the LR sweep: {len(replicates)} replicate runs at the cells' best LRs "
            f"(seeds_at_best_lr), {sum(p.tokens for p in replicates):,} tokens, "
            f"{sum(p.flops for p in replicates):.3e} FLOPs, "
            f"{sum(p.gpu_hours for p in replicates):,.0f} GPU-hours; "
            f"{sum(not p.fits for p in replicates)} do not fit"
        )
    extensions = getattr(plans, "extensions", [])
    if extensions:
        lines.append(
            f"LR sweep extensions past the cells' edges (lr_sweep.max_extensions): at most "
            f"{len(extensions)} runs, {sum(p.gpu_hours for p in extensions):,.0f} GPU-hours; "
            f"{sum(not p.fits for p in extensions)} do not fit"
        )
    if getattr(plans, "tokenization", None) is not None:
        lines.append(format_tokenization(plans.tokenization))
    return "\n".join(lines)
