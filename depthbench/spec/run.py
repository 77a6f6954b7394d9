"""A run of the grid: the leaf record that every stage (training, probes, NLL, cost, launch)
reads. It imports only the dataclasses it holds, so that nothing here imports the grid expansion
or the training loop.

Each run gets a readable id `{arch}_L{n_layer}-d{d_model}_lr{lr}_s{seed}_{hash}` (made by
depthbench.grid.config.expand_grid) where the hash covers `identity_dict`: everything that changes
training (model config, recipe, data), so that editing the grid adds runs instead of silently
reusing old ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass, replace
from typing import Any

from depthbench.models.config import ModelConfig
from depthbench.spec.shape_count import Shape
from depthbench.spec.training import TrainConfig


def short_hash(obj: Any, n: int = 8) -> str:
    """A stable hash of a JSON-serialisable object (key order does not matter)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:n]


@dataclass
class RunSpec:
    run_id: str
    arch: str
    shape: Shape
    lr: float
    seed: int
    knobs: dict[str, Any]
    model: ModelConfig
    train: TrainConfig
    data_id: str
    tokenizer_id: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "arch": self.arch,
            "shape": asdict(self.shape),
            "lr": self.lr,
            "seed": self.seed,
            "knobs": self.knobs,
            "model": self.model.to_dict(),
            "train": self.train.to_dict(),
            "data_id": self.data_id,
            "tokenizer_id": self.tokenizer_id,
        }

    def identity_dict(self) -> dict[str, Any]:
        """What determines the trained weights and curves, exactly what the run id hashes:
        no operational settings (threads, checkpoint and log intervals, device, compile) and no
        setting added after v1 at its default. Snakemake's params of the train and probe rules,
        so that neither an operational change nor a new setting in the code reruns training;
        `from_dict` restores the omitted fields at their defaults."""
        d = self.to_dict()
        d["model"] = _hashed(d["model"], MODEL_FIELDS_V1, ModelConfig)
        d["train"] = _hashed(self.train.hashed_dict(), TRAIN_FIELDS_V1, TrainConfig)
        return d

    def spec_hash(self) -> str:
        """A hash of `identity_dict`: what a run's summary.json records (`spec_hash`) and the
        tables check against the grid's, so that a summary of another run or of an older
        version of this grid is refused by name instead of entering the tables."""
        return short_hash(self.identity_dict(), 16)

    def with_operational(self, train_section: dict[str, Any]) -> "RunSpec":
        """A copy with the operational (unhashed) training settings taken from the config."""
        train = replace(
            self.train,
            **{k: train_section[k] for k in TrainConfig.NOT_HASHED if k in train_section},
        )
        return replace(self, train=train)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunSpec":
        return cls(
            run_id=d["run_id"],
            arch=d["arch"],
            shape=Shape(**d["shape"]),
            lr=d["lr"],
            seed=d["seed"],
            knobs=d["knobs"],
            model=ModelConfig.from_dict(d["model"]),
            train=TrainConfig.from_dict(d["train"]),
            data_id=d["data_id"],
            tokenizer_id=d["tokenizer_id"],
        )


# Fields that existed when run ids were introduced are always hashed. A field added later enters
# the hash only when it differs from its default, so adding a setting to the code does not
# rename (and so retrain) every existing run.
MODEL_FIELDS_V1 = frozenset(
    {
        "arch",
        "vocab_size",
        "d_model",
        "n_layer",
        "n_head",
        "n_kv_head",
        "d_ff",
        "max_seq_len",
        "rope_theta",
        "norm_eps",
        "init_std",
        "arch_options",
        "moe",
    }
)
TRAIN_FIELDS_V1 = frozenset(
    {
        "lr",
        "seed",
        "seq_len",
        "global_batch_size",
        "micro_batch_size",
        "tokens_per_param",
        "max_steps",
        "total_steps",
        "weight_decay",
        "beta1",
        "beta2",
        "adam_eps",
        "grad_clip",
        "warmup_fraction",
        "min_lr_ratio",
        "eval_every",
        "eval_batches",
        "divergence_factor",
        "dtype",
    }
)


def _hashed(values: dict, v1_fields: frozenset, cls) -> dict:
    defaults = {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(cls)
    }
    return {k: v for k, v in values.items() if k in v1_fields or v != defaults.get(k)}
