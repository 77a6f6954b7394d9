"""The architecture list lives in the registry alone: the config schema's names and options, the
figures' colour order and the tests' architecture lists are read from it, so an architecture
registered at test time is a valid config name (and its options valid options) for exactly as
long as it is registered, and takes the next colour without moving the others'."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from matplotlib.colors import to_hex

from depthbench.analysis.style import arch_style
from depthbench.models.archs.pre_ln import PreLN
from depthbench.models.base import ArchOptions
from depthbench.models.registry import (
    ALIASES,
    ARCHITECTURES,
    PACKAGE_ARCHITECTURES,
    build_model,
    count_parameters,
    parameters_on_meta,
    register,
    registered,
    registration_order,
    style_order,
    unregister,
)
from depthbench.spec.schema import load_config, load_schema
from depthbench.util.errors import ConfigError
from tests.conftest import tiny_config

# The package's architectures with the colour (tab10's, then black) and marker each has had in
# every figure; a change here recolours the default figures.
CURRENT_STYLE = {
    "pre_ln": ("#1f77b4", "o"),
    "post_ln": ("#ff7f0e", "s"),
    "peri_ln": ("#2ca02c", "D"),
    "lns": ("#d62728", "^"),
    "deepnorm": ("#9467bd", "v"),
    "keel": ("#8c564b", "<"),
    "hc": ("#e377c2", ">"),
    "mhc": ("#7f7f7f", "p"),
    "attnres_full": ("#bcbd22", "h"),
    "attnres_block": ("#17becf", "*"),
    "moda": ("#000000", "X"),
}


@dataclass(frozen=True)
class LaterOptions(ArchOptions):
    later_scale: float = 1.0


class Later(PreLN):
    """An architecture no module of the package registers."""

    Options = LaterOptions


def config(**overrides) -> dict:
    # Validation reads the schema only: the corpus file is never opened.
    return tiny_config(Path("corpus.jsonl"), **overrides)


def snapshot():
    return list(ARCHITECTURES.items()), list(ALIASES.items())


def test_a_name_registered_at_test_time_is_valid_while_registered():
    before = snapshot()
    with registered(Later, "later_ln", "later_alias"):
        loaded = load_config(
            config(
                architectures=["later_ln", "pre_ln"],
                learning_rates_by_arch={"later_alias": [1e-3]},
                model={"n_head": 2, "arch_options": {"later_scale": 0.5}},
            )
        )
        assert loaded["architectures"] == ["later_ln", "pre_ln"]
        assert loaded["model"]["arch_options"] == {"later_scale": 0.5}
        with pytest.raises(ConfigError, match=r"model\.arch_options\.later_scale"):
            load_config(config(model={"n_head": 2, "arch_options": {"later_scale": "big"}}))
        schema = load_schema()["properties"]
        names = schema["architectures"]["items"]["enum"]
        assert names[-3:] == ["later_ln", "later_alias", "sandwich_ln"]
        assert schema["learning_rates_by_arch"]["propertyNames"]["enum"] == names
    assert snapshot() == before
    with pytest.raises(ConfigError) as err:
        load_config(config(architectures=["later_ln"]))
    assert err.value.field == "architectures[0]"
    with pytest.raises(ConfigError, match=r"learning_rates_by_arch"):
        load_config(config(learning_rates_by_arch={"later_alias": [1e-3]}))
    with pytest.raises(ConfigError, match=r"model\.arch_options.*later_scale"):
        load_config(config(model={"arch_options": {"later_scale": 0.5}}))


def test_an_unknown_architecture_is_refused_naming_the_field_and_every_valid_name():
    with pytest.raises(ConfigError) as err:
        load_config(config(architectures=["pre_ln", "transformer_xl"]))
    assert err.value.field == "architectures[1]"
    message = str(err.value)
    assert "'transformer_xl'" in message
    for name in [*CURRENT_STYLE, "sandwich_ln"]:
        assert f"'{name}'" in message, name


def test_the_yaml_lists_no_architecture_and_the_loaded_schema_every_one():
    import yaml

    from depthbench.spec.schema import SCHEMA_PATH

    raw = yaml.safe_load(SCHEMA_PATH.read_text())["properties"]
    assert "enum" not in raw["architectures"]["items"]
    assert "enum" not in raw["learning_rates_by_arch"]["propertyNames"]
    names = load_schema()["properties"]["architectures"]["items"]["enum"]
    assert names == [*CURRENT_STYLE, "sandwich_ln"]


def test_registration_keeps_the_order_of_the_package_then_later_ones():
    assert registration_order() == list(CURRENT_STYLE)
    with registered(Later, "later_ln"):
        assert registration_order() == [*CURRENT_STYLE, "later_ln"]
    assert registration_order() == list(CURRENT_STYLE)


def test_a_name_or_alias_already_taken_is_refused_and_an_unknown_one_not_unregistered():
    before = snapshot()
    with pytest.raises(ValueError, match="'sandwich_ln' registered twice"):
        register("later_ln", "sandwich_ln")(Later)
    with pytest.raises(ValueError, match="'pre_ln' registered twice"):
        register("pre_ln")(Later)
    with pytest.raises(ValueError, match="'later_ln' is not registered"):
        unregister("later_ln")
    assert snapshot() == before


def style_of(arch: str) -> tuple[str, str]:
    style = arch_style(arch)
    return to_hex(style["color"]), style["marker"]


def test_the_order_figures_read_without_the_modules_is_the_registration_order():
    """Figure jobs colour by style_order(), which imports no architecture module: it must be the
    order the modules register in (each module registering its own name), later ones included."""
    assert style_order() == registration_order()
    with registered(Later, "later_ln"):
        assert style_order() == registration_order() == [*CURRENT_STYLE, "later_ln"]
    assert style_order() == list(CURRENT_STYLE)


def test_the_package_architectures_keep_their_colours_and_markers():
    assert {arch: style_of(arch) for arch in CURRENT_STYLE} == CURRENT_STYLE


def test_every_registered_architecture_gets_its_own_colour():
    with registered(Later, "later_ln"):
        colours = [style_of(arch)[0] for arch in registration_order()]
        assert len(colours) == len(CURRENT_STYLE) + 1
        assert len(set(colours)) == len(colours)
        assert {arch: style_of(arch) for arch in CURRENT_STYLE} == CURRENT_STYLE


COUNTED = [
    *({"arch": arch} for arch in PACKAGE_ARCHITECTURES),
    {"arch": "pre_ln", "n_kv_head": 1},
    {"arch": "pre_ln", "moe": {"n_experts": 4, "top_k": 2}},
    {"arch": "hc", "arch_options": {"n_streams": 2}},
    {"arch": "attnres_block", "arch_options": {"n_blocks": 2}},
    {"arch": "moda", "arch_options": {"variant": "ffn_kv"}},
]


@pytest.mark.parametrize("fields", COUNTED, ids=lambda f: "-".join(map(str, f.values())))
def test_parameters_are_counted_as_a_built_model_holds_them(fields):
    """count_parameters builds the weights on the meta device (parameters_on_meta): its count is
    the number of values a model built for real holds."""
    from depthbench.models.config import ModelConfig

    cfg = ModelConfig(
        **{"vocab_size": 97, "d_model": 32, "n_layer": 4, "n_head": 2, "max_seq_len": 16, **fields}
    )
    built = build_model(cfg)
    assert count_parameters(cfg) == sum(p.numel() for p in built.parameters())
    with parameters_on_meta():
        meta = build_model(cfg, initialize=False)
    # the weights hold no memory: only constants smaller than a d_model vector (HC's static
    # eye(n_streams)) are built on the CPU
    on_cpu = {name: p.numel() for name, p in meta.named_parameters() if not p.is_meta}
    assert all(n < cfg.d_model for n in on_cpu.values()), on_cpu


def test_a_model_built_for_its_shapes_computes_no_rope_table():
    """Solving a preset's shapes builds hundreds of models on meta (count_parameters): RoPE's
    tables are meta tensors of their shape there, and computing no value is what keeps a build
    cheap at max_seq_len 4096; a real build holds the tables, cos and sin of position x inverse
    frequency (GPT-NeoX half-split pairing)."""
    from depthbench.models.config import ModelConfig
    from depthbench.models.registry import build_model, parameters_on_meta

    cfg = ModelConfig(arch="pre_ln", vocab_size=97, d_model=32, n_layer=2, n_head=2, max_seq_len=64)
    for meta_build in (parameters_on_meta, lambda: torch.device("meta")):
        with meta_build():
            rope = build_model(cfg, initialize=False).rope
        assert rope.cos.is_meta and rope.sin.is_meta
        assert rope.cos.shape == rope.sin.shape == (64, cfg.head_dim // 2)
    rope = build_model(cfg).rope
    inv_freq = [1.0 / 10000.0 ** (2 * i / cfg.head_dim) for i in range(cfg.head_dim // 2)]
    angles = torch.tensor([[t * f for f in inv_freq] for t in range(64)], dtype=torch.float64)
    for table, expected in ((rope.cos, angles.cos()), (rope.sin, angles.sin())):
        assert table.dtype == torch.float32 and torch.allclose(table.double(), expected, atol=1e-7)
