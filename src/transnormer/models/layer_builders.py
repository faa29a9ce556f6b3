"""Map a TransNormerConfig to layer constructor arguments, one builder per layer type."""

from __future__ import annotations

from ..layers import DiagAttention, NormAttention, register_layer_type


def _norm_kwargs(config) -> dict:
    return {"norm_type": config.norm_type, "norm_eps": config.norm_eps, "eps_inside_sqrt": config.eps_inside_sqrt}


@register_layer_type("norm")
def build_norm_attention(config, layer_idx: int) -> NormAttention:
    return NormAttention(
        config.hidden_size,
        config.num_attention_heads,
        causal=config.causal,
        kernel=config.resolved("norm_kernel"),
        chunk_size=config.chunk_size,
        lrpe=config.lrpe,
        lrpe_learn_theta=config.lrpe_learn_theta,
        lrpe_seed=config.lrpe_seed * 1000 + layer_idx,
        norm_per_head=config.norm_per_head,
        **_norm_kwargs(config),
        **config.options_for("norm"),
    )


@register_layer_type("diag")
def build_diag_attention(config, layer_idx: int) -> DiagAttention:
    return DiagAttention(
        config.hidden_size,
        config.diag_num_attention_heads or config.num_attention_heads,
        causal=config.causal,
        kernel=config.resolved("diag_kernel"),
        block_size=config.block_size,
        use_norm=config.resolved("diag_norm"),
        lrpe=config.lrpe,
        lrpe_learn_theta=config.lrpe_learn_theta,
        lrpe_seed=config.lrpe_seed * 1000 + layer_idx,
        attention_dropout=config.attention_dropout,
        **_norm_kwargs(config),
        **config.options_for("diag"),
    )
