"""The model configuration dataclass shared by every architecture.

Its defaults are those of the config schema (workflow/schemas/config.schema.yaml) for the
settings the schema carries; tests/unit/test_defaults.py holds every field to it or names why
the schema has none (the fields resolved per run: arch, vocab_size and the shape)."""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import asdict, dataclass, field
from typing import Any

from depthbench.util.errors import ConfigError

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}


def evaluate_init_std(rule: float | int | str, d_model: int, n_layer: int) -> float:
    """Resolve the init standard deviation: a number, or an arithmetic rule in d_model/n_layer.

    Rules such as ``"1/sqrt(d_model)"`` or ``"0.02/sqrt(2*n_layer)"`` are evaluated by a tiny
    arithmetic interpreter (numbers, + - * / **, sqrt, and the names d_model and n_layer), never
    by ``eval``.
    """
    if isinstance(rule, (int, float)) and not isinstance(rule, bool):
        value = float(rule)
    elif isinstance(rule, str):
        names = {"d_model": float(d_model), "n_layer": float(n_layer)}

        def walk(node: ast.AST) -> float:
            if isinstance(node, ast.Expression):
                return walk(node.body)
            if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
                return float(node.value)
            if isinstance(node, ast.Name) and node.id in names:
                return names[node.id]
            if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
                return _BINOPS[type(node.op)](walk(node.left), walk(node.right))
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
                return -walk(node.operand)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "sqrt"
                and len(node.args) == 1
            ):
                return math.sqrt(walk(node.args[0]))
            raise ConfigError(
                "model.init_std",
                f"cannot evaluate {rule!r}: use a number or arithmetic in d_model, n_layer and "
                "sqrt(), e.g. '1/sqrt(d_model)'",
            )

        try:
            value = walk(ast.parse(rule, mode="eval"))
        except SyntaxError as exc:
            raise ConfigError("model.init_std", f"cannot parse {rule!r}: {exc.msg}") from None
        except (ArithmeticError, ValueError, RecursionError, MemoryError) as exc:
            # 10**10**10 overflows, sqrt(-1) is a domain error, 1/(d_model-d_model) divides by 0
            # (the interpreter works in floats, so no rule can build a huge integer)
            what = {ZeroDivisionError: "divides by zero", OverflowError: "overflows"}.get(
                type(exc), str(exc) or type(exc).__name__
            )
            raise ConfigError(
                "model.init_std",
                f"{rule!r} at d_model={d_model}, n_layer={n_layer}: {what}; it must evaluate "
                "to a positive number",
            ) from None
    else:
        raise ConfigError("model.init_std", f"expected a number or a rule string, got {rule!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError("model.init_std", f"{rule!r} evaluates to {value}, must be positive")
    return value


def valid_head_counts(d_model: int, limit: int = 64) -> list[int]:
    """Head counts up to `limit` that divide d_model into an even head dimension (RoPE rotates
    pairs), i.e. every count that passes both checks of ModelConfig.check."""
    return [h for h in range(1, limit + 1) if d_model % h == 0 and (d_model // h) % 2 == 0]


def swiglu_hidden(d_model: int, multiple: int = 64) -> int:
    """SwiGLU width d_ff = 8/3 d_model rounded to the nearest multiple (LLaMA's choice)."""
    return max(multiple, int(round(8 * d_model / 3 / multiple)) * multiple)


@dataclass
class ModelConfig:
    """Everything that defines a model's architecture and initialization."""

    arch: str = "pre_ln"
    vocab_size: int = 50280
    d_model: int = 768
    n_layer: int = 12
    n_head: int = 16
    n_kv_head: int | None = None  # None: equal to n_head (MHA); fewer gives GQA
    d_ff: int | None = None  # None: 8/3 d_model rounded to a multiple of 64
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float | str = 0.02
    arch_options: dict[str, Any] = field(default_factory=dict)
    # Mixture of experts for the FFN: {} (dense) or n_experts, top_k, aux_loss_coef, d_ff_expert.
    moe: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.d_ff is None:
            self.d_ff = swiglu_hidden(self.d_model)
        self.check()

    def check(self) -> None:
        for name in (
            "vocab_size",
            "d_model",
            "n_layer",
            "n_head",
            "n_kv_head",
            "d_ff",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.{name}", f"must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ConfigError(
                "model.n_head",
                f"d_model {self.d_model} is not divisible by n_head {self.n_head}; valid head "
                f"counts for this width: {valid_head_counts(self.d_model)}",
            )
        if (self.d_model // self.n_head) % 2:
            raise ConfigError(
                "model.n_head",
                f"head dimension {self.d_model // self.n_head} must be even for RoPE",
            )
        if self.n_head % self.n_kv_head:
            raise ConfigError(
                "model.n_kv_head",
                f"n_head {self.n_head} is not a multiple of n_kv_head {self.n_kv_head}",
            )
        evaluate_init_std(self.init_std, self.d_model, self.n_layer)
        if self.moe.get("n_experts", 0):
            n, k = self.moe["n_experts"], self.moe.get("top_k", 2)
            if not 1 <= k <= n:
                raise ConfigError(
                    "model.moe.top_k", f"must be between 1 and n_experts {n}, got {k}"
                )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def resolved_init_std(self) -> float:
        return evaluate_init_std(self.init_std, self.d_model, self.n_layer)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        return cls(**data)
