"""The config schema is the one source of defaults: every field of ModelConfig and TrainConfig
that the schema carries defaults to the schema's value (same type too: the run id hashes the
JSON of the settings, where 20 and 20.0 differ), and every other field is named below with the
reason the schema has no default for it. A new field that is neither fails the test."""

import dataclasses

import pytest

from depthbench.models.config import ModelConfig
from depthbench.models.moe import MoESwiGLU
from depthbench.spec.schema import load_schema
from depthbench.spec.training import TrainConfig


def first(values: list):
    return values[0]


# field -> (schema path, what of the schema's default the field takes; None: all of it)
MODEL_FROM_SCHEMA = {
    "n_head": ("model.n_head", None),
    "n_kv_head": ("model.n_kv_head", None),
    "rope_theta": ("model.rope_theta", None),
    "norm_eps": ("model.norm_eps", None),
    "init_std": ("model.init_std", None),
    "arch_options": ("model.arch_options", None),
    "moe": ("model.moe", None),
    # the grid builds every model for its training sequence length (grid.config.expand_grid)
    "max_seq_len": ("train.seq_len", None),
}
MODEL_NOT_IN_SCHEMA = {
    "arch": "one per entry of `architectures`, which the schema requires (no default)",
    "vocab_size": "the tokenizer's, known once it is trained or loaded",
    "d_model": "resolved per shape by the shape solver (spec.shapes)",
    "n_layer": "given or resolved per shape (shapes[i].n_layer or ratio)",
    "d_ff": "resolved per shape by the shape solver (spec.shapes)",
}
TRAIN_FROM_SCHEMA = {
    name: (f"train.{name}", None)
    for name in (
        "seq_len",
        "global_batch_size",
        "micro_batch_size",
        "tokens_per_param",
        "max_steps",
        "weight_decay",
        "beta1",
        "beta2",
        "adam_eps",
        "grad_clip",
        "warmup_fraction",
        "min_lr_ratio",
        "eval_every",
        "eval_batches",
        "checkpoint_every",
        "log_every",
        "divergence_factor",
        "dtype",
        "device",
        "threads",
        "compile",
        "activation_checkpointing",
        "kernels",
        "loss_chunk_tokens",
        "dynamics_every",
        "parallel",
        "loggers",
    )
}
TRAIN_FROM_SCHEMA["seed"] = ("seeds", first)  # the default grid's one seed
TRAIN_NOT_IN_SCHEMA = {
    "lr": "one per entry of `learning_rates`, which the schema requires (no default)",
    "total_steps": "resolved per run from tokens_per_param, the parameter count and max_steps",
    "experiment": "the config's top-level `name`, set with the operational settings by "
    "scripts/train.py; the grid expansion leaves it empty",
    "snapshot_steps": "resolved per run from probes.at_steps and the run's total steps",
}


def schema_default(path: str, schema: dict | None = None):
    node = schema or load_schema()
    for name in path.split("."):
        node = node["properties"][name]
    assert "default" in node, f"the schema has no default for {path}"
    return node["default"]


def field_default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def differences(cls, from_schema: dict, not_in_schema: dict, schema=None) -> list[str]:
    """Every way `cls` breaks the rule of the module docstring against `schema` (the config
    schema unless given), as readable lines."""
    out = []
    names = [f.name for f in dataclasses.fields(cls)]
    for name in sorted(set(from_schema) & set(not_in_schema)):
        out.append(f"{cls.__name__}.{name}: both mapped to the schema and listed as absent")
    for name in names:
        if name not in from_schema and name not in not_in_schema:
            out.append(f"{cls.__name__}.{name}: neither mapped to a schema path nor listed")
    for name in sorted((set(from_schema) | set(not_in_schema)) - set(names)):
        out.append(f"{cls.__name__}.{name}: not a field (remove it from the test's tables)")
    for f in dataclasses.fields(cls):
        if f.name not in from_schema:
            continue
        path, take = from_schema[f.name]
        wanted = schema_default(path, schema)
        wanted = take(wanted) if take else wanted
        value = field_default(f)
        if type(value) is not type(wanted) or value != wanted:
            out.append(f"{cls.__name__}.{f.name} = {value!r}, the schema's {path}: {wanted!r}")
    return out


@pytest.mark.parametrize(
    "cls, from_schema, not_in_schema",
    [
        (ModelConfig, MODEL_FROM_SCHEMA, MODEL_NOT_IN_SCHEMA),
        (TrainConfig, TRAIN_FROM_SCHEMA, TRAIN_NOT_IN_SCHEMA),
    ],
    ids=["ModelConfig", "TrainConfig"],
)
def test_every_dataclass_default_is_the_schemas(cls, from_schema, not_in_schema):
    assert differences(cls, from_schema, not_in_schema) == []


@pytest.mark.parametrize(
    "section, fields", [("model", MODEL_NOT_IN_SCHEMA), ("train", TRAIN_NOT_IN_SCHEMA)]
)
def test_the_fields_listed_as_absent_have_no_default_in_their_section(section, fields):
    """A listed field that the schema comes to carry must be mapped instead."""
    props = load_schema()["properties"][section]["properties"]
    assert [name for name in fields if "default" in props.get(name, {})] == []


def test_a_changed_default_on_either_side_is_caught():
    """The comparison itself: one default moved in the dataclass, or in the schema, is reported
    by name with both values."""

    @dataclasses.dataclass
    class Moved:
        n_head: int = 8

    line = "Moved.n_head = 8, the schema's model.n_head: 16"
    assert differences(Moved, {"n_head": ("model.n_head", None)}, {}) == [line]

    schema = load_schema()
    schema["properties"]["train"]["properties"]["beta2"]["default"] = 0.99
    assert differences(TrainConfig, TRAIN_FROM_SCHEMA, TRAIN_NOT_IN_SCHEMA, schema) == [
        "TrainConfig.beta2 = 0.95, the schema's train.beta2: 0.99"
    ]


def test_a_field_neither_mapped_nor_listed_fails():
    @dataclasses.dataclass
    class Grown:
        n_head: int = 16
        new_setting: int = 3

    assert differences(Grown, {"n_head": ("model.n_head", None)}, {}) == [
        "Grown.new_setting: neither mapped to a schema path nor listed"
    ]


def test_expert_defaults_are_the_schemas():
    """The options of model.moe that a config may leave out take the schema's defaults in the
    expert layer: top_k, aux_loss_coef, and d_ff_expert (null: the dense d_ff)."""
    cfg = ModelConfig(arch="pre_ln", vocab_size=64, d_model=32, n_layer=1, n_head=2)
    layer = MoESwiGLU(dataclasses.replace(cfg, moe={"n_experts": 4}))
    assert layer.top_k == schema_default("model.moe.top_k") == 2
    assert layer.aux_loss_coef == schema_default("model.moe.aux_loss_coef")
    assert schema_default("model.moe.d_ff_expert") is None and layer.d_ff == cfg.d_ff
