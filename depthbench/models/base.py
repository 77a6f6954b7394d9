"""The decoder LM shared by every architecture.

An architecture is a subclass of `DecoderLM` registered by name (depthbench.models.registry).
Single-stream architectures (the normalization family) only supply a `Block` class and say
whether a final norm exists; multi-stream or aggregating ones override `trunk`.

Residual stream convention (docs/design/architectures.md): h_l is what layer l + 1 reads before
its own input norm; h_0 is the embedding output and h_L the input of the final norm (never its
output).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from depthbench.util.errors import ConfigError
from depthbench.models.config import ModelConfig
from depthbench.models.layers import CausalSelfAttention, RMSNorm, RotaryEmbedding, SwiGLU
from depthbench.models.loss import chunked_cross_entropy
from depthbench.models.stepping import LayerFold

Rope = tuple[torch.Tensor, torch.Tensor]

# Probes every architecture supports (depthbench.probes.run writes rows under these names); an
# architecture adds its own in `DecoderLM.probes` (hc/mhc: residual_product_rank, attnres:
# depth_weight, ...) and may drop one it cannot define (moda: the prefix-average intervention).
GENERIC_PROBES = frozenset(
    {
        "token_similarity",
        "prefix_average",
        "effective_rank",
        "angular_distance",
        "causal_score",
        "permutation_score",
        "usefulness_ratio",
        "logit_lens",
    }
)


@dataclass
class ModelOutput:
    # None when the loss was computed in chunks (DecoderLM.loss_chunk_tokens)
    logits: torch.Tensor | None
    loss: torch.Tensor | None = None  # cross-entropy only
    hidden: list[torch.Tensor] | None = None  # h_0 .. h_L when requested
    aux_loss: torch.Tensor | None = (
        None  # weighted auxiliary losses (MoE load balancing); add to loss to train
    )
    internals: dict[str, list[torch.Tensor]] | None = (
        None  # per-sublayer records for probes, when requested
    )


@dataclass(frozen=True)
class ArchOptions:
    """An architecture's options, from `model.arch_options`: a subclass per architecture holds
    each option with its default, once. One `arch_options` section serves every architecture of a
    grid, so each takes its own fields and leaves the others'."""

    @classmethod
    def of(cls, cfg: ModelConfig) -> "ArchOptions":
        return cls.from_mapping(cfg.arch_options)

    @classmethod
    def from_mapping(cls, options: dict) -> "ArchOptions":
        """This architecture's options from a shared `arch_options` mapping: its own fields, the
        rest at their defaults; the other architectures' keys are left out."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in options.items() if k in names})

    def require(self, name: str, valid: tuple) -> None:
        """ConfigError naming `model.arch_options.<name>` unless its value is one of `valid`."""
        if getattr(self, name) not in valid:
            raise ConfigError(
                f"model.arch_options.{name}", f"{getattr(self, name)!r}; valid: {list(valid)}"
            )


class Block(nn.Module):
    """One layer: an attention sublayer and a SwiGLU sublayer, placed by the subclass.

    `layer_index` is 1-based (l = 1..L) because constants such as LNS's 1/sqrt(l) use it.
    """

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.attn = CausalSelfAttention(cfg)
        self.ffn = make_ffn(cfg)

    def forward(self, x: torch.Tensor, rope: Rope, internals: dict | None = None) -> torch.Tensor:
        raise NotImplementedError("each architecture's Block defines its residual update")


def make_ffn(cfg: ModelConfig) -> nn.Module:
    """The FFN sublayer: dense SwiGLU, or a top-k mixture of SwiGLU experts when cfg.moe asks."""
    if cfg.moe.get("n_experts", 0) > 0:
        from depthbench.models.moe import MoESwiGLU

        return MoESwiGLU(cfg)
    return SwiGLU(cfg)


class DecoderLM(nn.Module, LayerFold):
    """Embedding -> trunk of L layers -> optional final RMSNorm -> untied LM head.

    It is its own model adapter (depthbench.models.adapter) through `LayerFold`
    (depthbench.models.stepping), whose defaults serve every architecture whose trunk state is
    one tensor (the normalization family, hc, mhc); an architecture with side state (attnres's
    sources, moda's depth keys) overrides the value-level hooks `init_state`, `read_stream`,
    `layer_step`, `fork_state`, `skip_layer`, `layer_features` and `from_layer_features` in its
    own module."""

    arch_name: ClassVar[str] = ""
    # What can be measured and drawn for this architecture: the probe families it supports and
    # the architecture-specific figures a grid containing it gets (beyond the generic ones).
    probes: ClassVar[frozenset[str]] = GENERIC_PROBES
    figures: ClassVar[frozenset[str]] = frozenset()
    Options: ClassVar[type[ArchOptions]] = ArchOptions
    block_class: ClassVar[type[Block]] = Block
    has_final_norm: ClassVar[bool] = True
    # True when a layer computes with a constant of its position l or of the depth L, not a
    # parameter (LNS's 1/sqrt(l), DeepNorm's and KEEL's alpha, AttnRes block boundaries): the
    # model with layer s skipped is then not the (L - 1)-layer model with the other layers'
    # weights copied in, whose constants are those of the new positions.
    position_bound_constants: ClassVar[bool] = False
    position_offset: int = 0  # position of idx[:, 0]; > 0 only while decoding with a KV cache
    # forward(idx, targets) with more target tokens than this computes the loss in chunks of this
    # many tokens and returns no logits; 0 = the plain loss with logits (set by the trainer from
    # train.loss_chunk_tokens; probes, NLL and the adapter's `logits` never chunk)
    loss_chunk_tokens: int = 0

    def __init__(self, cfg: ModelConfig, initialize: bool = True):
        super().__init__()
        self.cfg = cfg
        self.options = self.Options.of(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(
            [self.block_class(cfg, layer_index) for layer_index in range(1, cfg.n_layer + 1)]
        )
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if self.has_final_norm else None
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        if initialize:
            self.reset_parameters()

    # -- initialization -------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """Default init: every Linear and Embedding weight ~ N(0, init_std); norm gains 1."""
        std = self.cfg.resolved_init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif hasattr(module, "init_weights"):  # modules with raw parameters (MoE experts)
                module.init_weights(std)
        self.init_architecture()

    def init_architecture(self) -> None:
        """Hook for architectures with their own init (DeepNorm, HC's static weights...)."""

    # -- forward ----------------------------------------------------------------------------
    def embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """h_0: the embedding output (an architecture may normalize it)."""
        return self.embed(idx)

    def trunk(
        self, h0: torch.Tensor, rope: Rope, hidden: list | None, internals: dict | None
    ) -> torch.Tensor:
        """Run the L layers on h_0 and return h_L, appending h_0..h_L to `hidden` if given."""
        state = self.init_state(h0)
        if hidden is not None:
            hidden.append(self.read_stream(state))
        for block in self.blocks:
            state = block(state, rope, internals)
            if hidden is not None:
                hidden.append(self.read_stream(state))
        return self.read_stream(state)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        return_hidden: bool = False,
        return_internals: bool = False,
    ) -> ModelOutput:
        T = idx.shape[1]
        h0 = self.embed_tokens(idx)
        hidden = [] if return_hidden else None
        internals = {} if return_internals else None
        x = self.trunk(h0, self.rope(T, self.position_offset), hidden, internals)
        if self.final_norm is not None:
            x = self.final_norm(x)
        logits, loss = None, None
        if targets is not None and 0 < self.loss_chunk_tokens < targets.numel():
            # head and loss a chunk of tokens at a time: no (N, V) logits (depthbench.models.loss)
            loss = chunked_cross_entropy(x, self.lm_head.weight, targets, self.loss_chunk_tokens)
        else:
            logits = self.lm_head(x)
            if targets is not None:
                # Cross-entropy in fp32 whatever the autocast dtype.
                loss = F.cross_entropy(
                    logits.float().view(-1, logits.shape[-1]), targets.reshape(-1)
                )
        aux = [b.ffn.aux_loss for b in self.blocks if getattr(b.ffn, "aux_loss", None) is not None]
        aux_loss = torch.stack(aux).sum() if aux else None
        return ModelOutput(
            logits=logits, loss=loss, hidden=hidden, aux_loss=aux_loss, internals=internals
        )

    # -- sharding -----------------------------------------------------------------------------
    def fsdp_units(self) -> list[nn.Module]:
        """The submodules FSDP2 shards as separate units (one all-gather each). A unit's
        parameters are gathered only inside its own forward, so every unit must be a module the
        trunk calls; parameters read outside any unit's forward (attnres's pseudo-queries) stay
        in the root unit. Default: one unit per layer."""
        return list(self.blocks)

    def checkpoint_units(self) -> list[nn.Module]:
        """The modules activation checkpointing recomputes one at a time (and per-block compile
        compiles; depthbench.train.parallelize), which the memory estimate traces per unit.
        Each must be called by the trunk as a whole. Default: the FSDP2 units."""
        return self.fsdp_units()

    # -- accounting -------------------------------------------------------------------------
    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Total parameters as built (every expert of an MoE counted)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.embed.weight.numel() + self.lm_head.weight.numel()
        return total

    def num_active_parameters(self) -> int:
        """Parameters used per token: an MoE layer counts its router and its top-k experts only."""
        inactive = sum(getattr(b.ffn, "inactive_parameters", 0) for b in self.blocks)
        return self.num_parameters() - inactive
