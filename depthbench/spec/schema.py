"""The config schema (workflow/schemas/config.schema.yaml), the one place every setting's default
lives, and the validation of a config against it: `load_config` reads a YAML file (naming the
file and line of a syntax error), `validate_schema` fills defaults and names the first invalid
field. The architecture names and options come from the registry (depthbench.models.registry),
which `load_schema` adds. A leaf module, so that the stages (probes, NLL) can read their defaults
without importing the grid expansion (depthbench.grid.config)."""

from __future__ import annotations

import copy
import math
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from depthbench.util.errors import ConfigError

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "config.schema.yaml"


@lru_cache(maxsize=1)
def _schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def load_schema() -> dict:
    """A fresh copy of the schema, with the architecture registry's names and options filled in
    (`_with_registry`): read on every call, so an architecture registered later is in it."""
    return _with_registry(copy.deepcopy(_schema()))


# The JSON Schema type of an option's annotation in its architecture's Options dataclass.
_OPTION_TYPES = {"bool": "boolean", "int": "integer", "float": "number", "str": "string"}


def _with_registry(schema: dict) -> dict:
    """`schema` (in place) with what the architecture registry alone lists: every registered
    name and alias as the enum of `architectures` items and of `learning_rates_by_arch` keys,
    and under `model.arch_options` an entry for each option a registered architecture declares
    that the YAML does not describe (typed from its annotation; no default, since the default
    lives in the Options dataclass and the section holds only what a config sets)."""
    import dataclasses

    from depthbench.models.registry import ARCHITECTURES, accepted_names

    props = schema["properties"]
    props["architectures"]["items"]["enum"] = accepted_names()
    props["learning_rates_by_arch"]["propertyNames"]["enum"] = accepted_names()
    described = props["model"]["properties"]["arch_options"]["properties"]
    undescribed: dict[str, tuple] = {}  # option name: (its dataclass field, the archs declaring it)
    for arch, cls in ARCHITECTURES.items():
        for f in dataclasses.fields(cls.Options):
            if f.name not in described:
                undescribed.setdefault(f.name, (f, []))[1].append(arch)
    for name, (f, archs) in undescribed.items():
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        described[name] = {"description": f"{', '.join(archs)}: an option of its Options class"}
        if annotation in _OPTION_TYPES:
            described[name]["type"] = _OPTION_TYPES[annotation]
    return schema


def schema_defaults(section: str) -> dict:
    """The defaults the schema gives the fields of one top-level section (`probes`, `nll`, ...),
    for callers that get a partial section."""
    props = _schema()["properties"][section]["properties"]
    return {name: copy.deepcopy(sub["default"]) for name, sub in props.items() if "default" in sub}


def with_defaults(section: str, values: dict) -> dict:
    """`values` of one top-level section with the schema's defaults filled in (nested objects too):
    for code that takes a section from a caller that may not have validated it."""

    def fill(schema: dict, value: dict) -> dict:
        out = dict(value)
        for name, sub in schema.get("properties", {}).items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if "properties" in sub and isinstance(out.get(name), dict):
                out[name] = fill(sub, out[name])
        return out

    return fill(_schema()["properties"][section], values)


# -- validation ------------------------------------------------------------------------------------
def _validator_with_defaults():
    import jsonschema

    base = jsonschema.Draft7Validator

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from base.VALIDATORS["properties"](validator, properties, instance, schema)

    return jsonschema.validators.extend(base, {"properties": set_defaults})


def _field_path(error) -> str:
    parts = []
    for p in error.absolute_path:
        if isinstance(p, int):
            parts[-1:] = [f"{parts[-1]}[{p}]"] if parts else [f"[{p}]"]
        else:
            parts.append(str(p))
    return ".".join(parts) or "<top level>"


_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)$")


def _coerce_numbers(value: Any, schema: dict) -> Any:
    """YAML 1.1 reads '8.0e5' (no exponent sign) as a string; where the schema wants a number
    and the string is a number in scientific notation, take the number."""
    types = schema.get("type", [])
    types = [types] if isinstance(types, str) else types
    if isinstance(value, str) and ("number" in types) and _FLOAT.match(value):
        return float(value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key in list(value):
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub:
                value[key] = _coerce_numbers(value[key], sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value[:] = [_coerce_numbers(v, schema["items"]) for v in value]
    return value


def _types(schema: dict) -> set[str]:
    types = schema.get("type", [])
    out = {types} if isinstance(types, str) else set(types)
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, []):
            out |= _types(sub)
    return out


def coerce_command_line(config: dict, overrides: dict) -> dict:
    """Snakemake's `--config key={...}` reads nested values as YAML with every scalar a string
    ('1', 'true', 'null'). Where such a string stands for a field whose schema type is integer,
    number, boolean or null, and reads (YAML) as a value of that type, the value in `config` (the
    merged config, in place) becomes it; anything else is left for validation to name."""
    schema = load_schema()

    def walk(target: Any, given: Any, sub: dict) -> Any:
        if isinstance(given, str) and isinstance(target, str) and target == given:
            wanted = _types(sub)
            if wanted & {"integer", "number", "boolean", "null"}:
                try:
                    value = yaml.safe_load(given)
                except yaml.YAMLError:
                    return target
                kind = {bool: "boolean", int: "integer", float: "number", type(None): "null"}.get(
                    type(value)
                )
                if kind in wanted or (kind == "integer" and "number" in wanted):
                    return value
            return target
        if isinstance(given, dict) and isinstance(target, dict):
            props, extra = sub.get("properties", {}), sub.get("additionalProperties")
            for key, value in given.items():
                child = props.get(key, extra if isinstance(extra, dict) else None)
                if key in target and child:
                    target[key] = walk(target[key], value, child)
        elif (
            isinstance(given, list)
            and isinstance(target, list)
            and isinstance(sub.get("items"), dict)
        ):
            target[:] = [walk(t, g, sub["items"]) for t, g in zip(target, given)] + target[
                len(given) :
            ]
        return target

    walk(config, overrides or {}, schema)
    return config


def validate_schema(config: dict) -> dict:
    """Validate against workflow/schemas/config.schema.yaml and fill in defaults (in place).

    The first error raises ConfigError naming the field and what would be valid.
    """
    schema = load_schema()
    _coerce_numbers(config, schema)
    _check_finite(config, "")
    validator = _validator_with_defaults()(schema)
    # Two passes: defaults are filled during the first, the second reports on the filled config.
    list(validator.iter_errors(config))
    errors = sorted(
        validator.iter_errors(config), key=lambda e: (len(e.absolute_path), str(e.absolute_path))
    )
    if errors:
        err = errors[0]
        message = err.message
        if err.validator == "additionalProperties":
            allowed = sorted(err.schema.get("properties", {}))
            message += f"; valid keys: {allowed}"
        elif err.validator in ("exclusiveMinimum", "minimum"):
            bound = ">" if err.validator == "exclusiveMinimum" else ">="
            message += f" (must be {bound} {err.validator_value})"
        raise ConfigError(_field_path(err), message)
    _check_sweep_values(config.get("sweep", {}), schema)
    return config


def _check_finite(value: Any, where: str) -> None:
    """Reject NaN and infinities anywhere (JSON Schema's bounds let them through: NaN compares
    false with every bound and .inf passes any minimum), naming the field."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(where or "<top level>", f"must be a finite number, got {value}")
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, sub in items:
        _check_finite(
            sub,
            f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else str(key),
        )


def _check_sweep_values(sweep: dict, schema: dict) -> None:
    """Each value of a sweep axis obeys the schema of the setting it replaces (a sweep is not a
    way around the ranges), e.g. sweep.train.weight_decay[1] = -1 fails like train.weight_decay."""
    import jsonschema

    for key, values in sweep.items():
        section, _, name = key.partition(".")
        sub = schema["properties"].get(section, {}).get("properties", {}).get(name)
        if sub is None:  # not a setting: _apply_knobs names the valid keys
            continue
        for i, value in enumerate(values):
            err = jsonschema.exceptions.best_match(
                jsonschema.Draft7Validator(sub).iter_errors(copy.deepcopy(value))
            )
            if err is not None:
                inner = _field_path(err)
                field = f"sweep.{key}[{i}]" + ("" if inner == "<top level>" else f".{inner}")
                raise ConfigError(field, err.message)


def load_config(source: str | os.PathLike | dict, overrides: dict | None = None) -> dict:
    """Read a YAML config (or take a dict), deep-merge overrides, validate and fill defaults."""
    if isinstance(source, dict):
        config = copy.deepcopy(source)
    else:
        path = Path(source)
        if not path.exists():
            raise ConfigError("<configfile>", f"{path} does not exist")
        config = read_yaml_config(path)
    if overrides:
        _deep_merge(config, overrides)
    return validate_schema(config)


def read_yaml_config(path: str | os.PathLike) -> dict:
    """The YAML mapping in `path`; a syntax error names the file, line and column."""
    path = Path(path)
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(
            "<configfile>", f"{path}: not UTF-8 text (byte offset {exc.start})"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError("<configfile>", f"{path}: {where}YAML syntax error: {problem}") from None
    if not isinstance(config, dict):
        raise ConfigError(
            "<configfile>",
            f"{path}: the top level must be a mapping of settings, got a {type(config).__name__}",
        )
    return config


def _deep_merge(base: dict, extra: dict) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
