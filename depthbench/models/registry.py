"""The architecture registry: every architecture module registers its `DecoderLM` subclass by
name (and aliases); the grid, the probes and the cost build models by name from here."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator

from depthbench.util.errors import ConfigError
from depthbench.models.config import ModelConfig

if TYPE_CHECKING:
    from depthbench.models.base import DecoderLM

# The package's architecture modules, each registering the architecture of its own name, in the
# order depthbench/models/archs/__init__.py imports them: the registration order, which fixes each
# architecture's colour and marker in figures. A new architecture goes last, so that the others
# keep theirs. Here, not only in the package, so that figure jobs know the order without importing
# the modules (and torch with them).
PACKAGE_ARCHITECTURES = (
    "pre_ln",
    "post_ln",
    "peri_ln",
    "lns",
    "deepnorm",
    "keel",
    "hc",
    "mhc",
    "attnres_full",
    "attnres_block",
    "moda",
)

# In registration order (dicts keep insertion order).
ARCHITECTURES: dict[str, type["DecoderLM"]] = {}
ALIASES: dict[str, str] = {}


def register(name: str, *aliases: str) -> Callable[[type["DecoderLM"]], type["DecoderLM"]]:
    """Class decorator: make an architecture buildable by `name` (and by its aliases)."""

    def wrap(cls: type[DecoderLM]) -> type[DecoderLM]:
        for taken in (name, *aliases):
            if taken in ARCHITECTURES or taken in ALIASES:
                raise ValueError(f"architecture {taken!r} registered twice")
        cls.arch_name = name
        ARCHITECTURES[name] = cls
        for alias in aliases:
            ALIASES[alias] = name
        return cls

    return wrap


def canonical_arch(name: str) -> str:
    """The registered name for `name` or one of its aliases; ConfigError when unknown."""
    _import_architectures()
    if name in ARCHITECTURES:
        return name
    if name in ALIASES:
        return ALIASES[name]
    raise ConfigError(
        "architectures",
        f"unknown architecture {name!r}; valid: {sorted(ARCHITECTURES) + sorted(ALIASES)}",
    )


def unregister(name: str) -> None:
    """Remove architecture `name` and its aliases from the registry (an architecture registered
    for a test); ValueError naming the registered ones when `name` is not one of them."""
    if name not in ARCHITECTURES:
        raise ValueError(
            f"architecture {name!r} is not registered; registered: {list(ARCHITECTURES)}"
        )
    del ARCHITECTURES[name]
    for alias in [a for a, target in ALIASES.items() if target == name]:
        del ALIASES[alias]


@contextmanager
def registered(cls: type["DecoderLM"], name: str, *aliases: str) -> Iterator[type["DecoderLM"]]:
    """`cls` registered as `name` (and `aliases`) inside the `with` block only: on exit the
    registry holds exactly what it held before."""
    _import_architectures()  # the package's architectures first, so that they keep their order
    register(name, *aliases)(cls)
    try:
        yield cls
    finally:
        unregister(name)


def registered_architectures() -> list[str]:
    """Every registered architecture name (aliases not included), sorted."""
    _import_architectures()
    return sorted(ARCHITECTURES)


def registration_order() -> list[str]:
    """Every registered architecture name (aliases not included) in the order registered: the
    package's modules in the import order of depthbench/models/archs/__init__.py, then any
    registered later. Figures colour architectures by it (depthbench.analysis.style)."""
    _import_architectures()
    return list(ARCHITECTURES)


def style_order() -> list[str]:
    """registration_order() without importing the package's architecture modules (nor torch):
    the package's names, then any architecture registered since in this process. What figures
    colour by, in jobs that draw from tables and build no model."""
    return [*PACKAGE_ARCHITECTURES, *(a for a in ARCHITECTURES if a not in PACKAGE_ARCHITECTURES)]


def accepted_names() -> list[str]:
    """Every name a config may give an architecture by: the registered names in registration
    order, then the aliases, sorted."""
    return registration_order() + sorted(ALIASES)


def declared_options(arch: str, options: dict) -> dict:
    """The options `arch` declares (its `Options` dataclass), from a shared `arch_options`
    mapping, with its defaults filled in: what a model of `arch` reads, hence what its run id
    hashes and its model card lists. Keys other architectures declare are left out; a bad value
    of a declared option is a ConfigError naming it."""
    import dataclasses

    return dataclasses.asdict(
        ARCHITECTURES[canonical_arch(arch)].Options.from_mapping(options or {})
    )


def build_model(cfg: ModelConfig, initialize: bool = True) -> "DecoderLM":
    """Instantiate the registered architecture `cfg.arch` on the current device.

    `initialize=False` skips DepthBench's init (used on the meta device, where only shapes matter).
    """
    return ARCHITECTURES[canonical_arch(cfg.arch)](cfg, initialize=initialize)


def _import_architectures() -> None:
    # Importing the package registers every architecture module (PACKAGE_ARCHITECTURES).
    import depthbench.models.archs  # noqa: F401


def count_parameters(cfg: ModelConfig) -> int:
    """Exact parameter count of the model as built, without allocating its weights: they are
    built on the meta device (`parameters_on_meta`)."""
    with parameters_on_meta():
        model = build_model(cfg, initialize=False)
    return model.num_parameters()


def parameters_on_meta():
    """A context in which modules build their weights on the meta device, uninitialised, and
    everything else as usual: the storage factories (empty, zeros, ones, full, rand, randn) given
    no device make meta tensors, and the init functions leave a meta tensor as it is (it holds no
    values to set). RoPE's tables are meta tensors of their shape (the module sees a meta
    `torch.empty` and computes nothing); other small constants built otherwise (HC's static
    eye(n)) stay on the CPU.

    Not `torch.device("meta")`: that routes every factory to meta, and arange and eye on meta run
    Python reference kernels that import torch._dynamo on first use, seconds of every Snakemake
    start, `depthbench status` and plan, which count parameters to solve the grid's shapes."""
    import torch  # here, not at the top: the table and figure jobs read RunSpecs without torch
    from torch.overrides import TorchFunctionMode

    factories = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn}
    init = {
        *(getattr(torch.nn.init, name) for name in torch.nn.init.__all__ if name.endswith("_")),
        torch.Tensor.normal_,
        torch.Tensor.uniform_,
        torch.Tensor.zero_,
        torch.Tensor.fill_,
    }

    class ParametersOnMeta(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in factories and kwargs.get("device") is None:
                kwargs = {**kwargs, "device": "meta"}
            elif func in init:
                tensor = args[0] if args else kwargs["tensor"]
                if tensor.is_meta:
                    return tensor
            return func(*args, **kwargs)

    return ParametersOnMeta()
