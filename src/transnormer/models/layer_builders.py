"""Map a TransNormerConfig to layer constructor arguments, one builder per layer type."""

from __future__ import annotations

from ..layers import (
    FLASH,
    GAU,
    CosFormerAttention,
    DiagAttention,
    LinearAttention,
    NormAttention,
    Performer,
    SoftmaxAttention,
    register_layer_type,
)


def _norm_kwargs(config) -> dict:
    return {"norm_type": config.norm_type, "norm_eps": config.norm_eps, "eps_inside_sqrt": config.eps_inside_sqrt}


@register_layer_type("norm")
def build_norm_attention(config, layer_idx: int) -> NormAttention:
    """``layer_options["norm"]`` overrides any of these (an unknown option is a TypeError naming it)."""
    opts = {
        "causal": config.causal,
        "kernel": config.resolved("norm_kernel"),
        "chunk_size": config.chunk_size,
        "lrpe": config.lrpe,
        "lrpe_learn_theta": config.lrpe_learn_theta,
        "lrpe_seed": config.lrpe_seed * 1000 + layer_idx,
        "norm_per_head": config.norm_per_head,
        **_norm_kwargs(config),
        **config.options_for("norm"),
    }
    return _build("norm", NormAttention, config.hidden_size, config.num_attention_heads, **opts)


@register_layer_type("diag")
def build_diag_attention(config, layer_idx: int) -> DiagAttention:
    """``layer_options["diag"]`` overrides any of these (an unknown option is a TypeError naming it)."""
    opts = {
        "causal": config.causal,
        "kernel": config.resolved("diag_kernel"),
        "block_size": config.block_size,
        "use_norm": config.resolved("diag_norm"),
        "lrpe": config.lrpe,
        "lrpe_learn_theta": config.lrpe_learn_theta,
        "lrpe_seed": config.lrpe_seed * 1000 + layer_idx,
        "attention_dropout": config.attention_dropout,
        **_norm_kwargs(config),
        **config.options_for("diag"),
    }
    return _build("diag", DiagAttention, config.hidden_size,
                  config.diag_num_attention_heads or config.num_attention_heads, **opts)


# ------------------------------------------------------------------------------------------------
# Baselines (layer options from ``config.layer_options[<type>]``; unknown options raise TypeError)
# ------------------------------------------------------------------------------------------------
def _build(layer_type: str, cls, *args, **kwargs):
    try:
        return cls(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"layer_options[{layer_type!r}]: {e}") from e


@register_layer_type("softmax")
def build_softmax_attention(config, layer_idx: int) -> SoftmaxAttention:
    """Options: ``rope`` (bool, default False: the vanilla Transformer)."""
    opts = {"attention_dropout": config.attention_dropout, **config.options_for("softmax")}
    return _build("softmax", SoftmaxAttention, config.hidden_size, config.num_attention_heads,
                  causal=config.causal, **opts)


@register_layer_type("linear_elu")
def build_linear_attention(config, layer_idx: int) -> LinearAttention:
    """Options: ``denominator`` (True), ``eps`` (1e-6, in the denominator), ``kernel`` ("1+elu")."""
    opts = {"chunk_size": config.chunk_size, **config.options_for("linear_elu")}
    return _build("linear_elu", LinearAttention, config.hidden_size, config.num_attention_heads,
                  causal=config.causal, **opts)


@register_layer_type("performer")
def build_performer(config, layer_idx: int) -> Performer:
    """Options: ``num_features`` (⌊d_h ln d_h⌋), ``orthogonal`` (True), ``redraw_interval`` (1000),
    ``seed`` (0; layer i draws from seed·1000 + i), ``eps`` (0.0: the exact ratio; FAVOR+ key features
    are small enough that 1e-6 would bias it)."""
    opts = {"chunk_size": config.chunk_size, **config.options_for("performer")}
    if "feature_seed" in opts:  # (it had been replaced by the one derived from seed, silently)
        raise ValueError("layer_options['performer']['feature_seed'] is set per layer from the option 'seed' "
                         "(layer i draws from seed * 1000 + i): give seed instead")
    seed = opts.pop("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        # draw r of layer i uses (seed * 1000 + i) * 1_000_003 + r: within torch's 64-bit seeds
        raise ValueError(f"layer_options['performer']['seed'] must be an int in [0, 2**32), got {seed!r}")
    opts["feature_seed"] = seed * 1000 + layer_idx
    return _build("performer", Performer, config.hidden_size, config.num_attention_heads,
                  causal=config.causal, **opts)


@register_layer_type("cosformer")
def build_cosformer(config, layer_idx: int) -> CosFormerAttention:
    """Options: ``max_len`` M (causal default: ``max_position_embeddings``; bidirectional
    default None = each row's real length), ``eps`` (1e-6)."""
    opts = {"chunk_size": config.chunk_size, **config.options_for("cosformer")}
    opts.setdefault("max_len", config.max_position_embeddings if config.causal else None)
    return _build("cosformer", CosFormerAttention, config.hidden_size, config.num_attention_heads,
                  causal=config.causal, **opts)


@register_layer_type("gau")
def build_gau(config, layer_idx: int) -> GAU:
    """FLASH-Quad. Options: ``expansion`` (2: e = 2d), ``qk_dim`` (s = 128), ``normalizer``
    ("seq_len"), ``fixed_len`` (512), ``rel_bias`` ("toeplitz"), ``max_rel_len`` (512), ``rope`` ("full")."""
    opts = {"attention_dropout": config.attention_dropout, **config.options_for("gau")}
    return _build("gau", GAU, config.hidden_size, causal=config.causal, **opts)


@register_layer_type("flash")
def build_flash(config, layer_idx: int) -> FLASH:
    """FLASH. Options as ``gau`` plus ``chunk_size`` (C = 256, independent of config.chunk_size,
    which only tunes the speed of the linear layers), ``normalizer`` (global, "visible"),
    ``local_branch`` / ``global_branch`` (True)."""
    opts = {"attention_dropout": config.attention_dropout, **config.options_for("flash")}
    return _build("flash", FLASH, config.hidden_size, causal=config.causal, **opts)
