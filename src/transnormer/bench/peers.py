"""Peer implementations for side-by-side runs (peers.md), and exact parity with our GAU / FLASH.

Models (``build_peer_model``; the harness name is ``peer:NAME``, see ``bench/train_step.py``):

    flash-pytorch        flash_pytorch.FLASHTransformer, causal, sized like ``match`` (default
                         ``flash-lm``): same d, e = 2d, s, depth, group size = our chunk size, vocab
    flash-pytorch-gau    a causal LM assembled from flash_pytorch.GAU blocks (the package ships no
                         FLASH-Quad model), laid out like FLASHTransformer; sized like ``flash-quad-lm``
    performer-pytorch    performer_pytorch.PerformerLM, causal, sized like ``performer-lm`` (d, depth,
                         heads, dim_head, vocab); projections fixed (``fix_projection_matrices_()``)
    sdpa                 not a peer model: our ``vanilla-lm`` preset *is* the SDPA softmax baseline
                         (peers.md §3.1; on CPU in bf16 it runs our bf16 softmax kernel instead,
                         timed against SDPA by benchmarks/softmax_attn.py); asking for it raises
                         with that hint

Every model has ``is_peer = True``, ``forward(ids [B, T], mask=None) -> logits [B, T, V]``, a
``config`` namespace (``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``max_seq_len``),
``num_params`` and ``matched_params`` (our preset's count at the same vocabulary).

Equal parameters: peers keep their released architecture; two choices are ours [D]. (1) The head
is tied to the token embedding (``tie_embedding=True``), as in our presets; an untied head would
add V·d parameters (+46% for flash-lm at V = 32768). (2) ``align_init=True`` (with a tied head)
initialises the embedding as our LMs do, N(0, d^{-1/2}) instead of N(0, 1), so initial logits
have our scale instead of ~√d; the absolute positional signal is scaled by the same d^{-1/2} so
the token:position ratio at the input stays as released (FLASH: the ScaledSinuEmbedding scalar,
which flash.md §1.3 lists with α₀ = d^{-1/2} as the paper's value; Performer: its fixed
sinusoid buffer, not the rotary table). Remaining differences (released behaviour, kept):

    flash-pytorch:      T5 bias (32 buckets) instead of Toeplitz; partial interleaved RoPE over
                        min(32, s) dims instead of full rotate-half; token shift on; global
                        normaliser 1/C (grows with the chunk index) instead of "visible";
                        ScaleNorm with ε clamped outside the root; final LayerNorm, head bias
    flash-pytorch-gau:  T5 bias scaled by √d and divided by T with QKᵀ; 1/T normaliser counting
                        padding (not prefix-consistent, peers.md §3.2); no RoPE; no decode cache
    performer-pytorch:  GELU MLP 4d instead of our SiLU-GLU ⌊8d/3⌋ (same parameter count: 8d² vs
                        3d·8d/3); LayerNorm pre-norm instead of SRMSNorm; sinusoid + rotary
                        positions; causal leak through the key-feature max and ε (peers.md §3.4);
                        on CPU the causal path is the O(T·m·d_h)-memory fallback

Mixer/block parity (peers.md §2.2; flash.md): :func:`matching_block` builds OUR
``TransNormerBlock`` (pre-norm + GAU/FLASH + residual) configured to compute exactly what a given
``flash_pytorch.GAU`` / ``flash_pytorch.FLASH`` computes, and :func:`load_flash_pytorch_weights`
maps the weights. What coincides, and how:

  * projections: their ``to_hidden`` → [v | gate], ``to_qk`` → z; ours one dense layer → [u | v | z]
    with u the gate: rows are re-stacked (exact).
  * heads: their OffsetScale order (GAU: q, k; FLASH: quad_q, lin_q, quad_k, lin_k); ours (q, k) /
    (ql, kl, qg, kg): re-ordered (exact).
  * RoPE: theirs rotates interleaved pairs (2i, 2i+1) of the first r channels (FLASHTransformer:
    r = min(32, s)); ours rotates pairs (i, i + r/2) (``rope="partial:r"``). The two are the same
    rotation after a permutation of the s channels, and q·k is invariant under a permutation
    applied to both q and k, so the qk rows and the γ/β columns are permuted (exact); θ is copied.
  * T5 bias: same buckets (32, max distance 128); ours stores the table with their scale folded
    in (FLASH: √s). Their GAU adds the bias *before* dividing by T, ours after the normaliser, so
    the GAU table also gets a 1/T: the mapping holds for one tensor length T (``seq_len``).
  * normalisers: their GAU divides by the tensor length T (padding included) = our
    ``normalizer="fixed", fixed_len=T`` (exact with or without padding; ours ``seq_len`` is the
    same only without padding). Their FLASH: causal global 1/C = our ``normalizer="chunk"``
    (exact, also with right padding); non-causal 1/T = our ``visible`` (1/T_v) only without
    padding — with padding theirs counts the padded tokens (peers.md §3.2 bug), which no option of
    ours reproduces; the tests show it is the only difference by folding T_v/T into the global
    query head. The local branch divides by C in both.
  * norms: LayerNorm (exact, weights copied); their ScaleNorm clamps ‖x‖/√d at ε = 1e-5, ours puts
    ε inside the root: the matched block uses ε = 1e-30, so both are g·x/rms(x) whenever
    rms(x) > 1e-5 (equal up to rounding).
  * residual: both x + out (ours in the block, theirs inside the module).

Not matchable (``matching_block`` raises): FLASH ``shift_tokens=True`` (no token shift in ours),
``laplace_attn_fn=True``, ``reduce_group_non_causal_attn=False`` (chunk-local global branch),
xpos / learned-frequency variants of their rotary embedding, other norm classes; dropout must be
off (eval). In the other direction ours has options theirs lacks: Toeplitz / RoPE bias, full
RoPE in GAU, the "visible" causal normaliser, padding-exact normalisers, decode caches.
"""

from __future__ import annotations

import contextlib
import io
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn

PEER_NAMES = ("flash-pytorch", "flash-pytorch-gau", "performer-pytorch")
DEFAULT_MATCH = {"flash-pytorch": "flash-lm", "flash-pytorch-gau": "flash-quad-lm",
                 "performer-pytorch": "performer-lm"}
_PIP_HINT = "install the optional peers with: pip install -e '.[peers]'"
_VERSION_PACKAGES = ("torch", "flash-pytorch", "performer-pytorch", "rotary-embedding-torch", "einops",
                     "local-attention", "axial-positional-embedding")


_FLASH_MODULE, _PERFORMER_MODULE = "flash_pytorch.flash_pytorch", "performer_pytorch"
PEER_MODULES = {"flash-pytorch": _FLASH_MODULE, "flash-pytorch-gau": _FLASH_MODULE, "performer-pytorch": _PERFORMER_MODULE}


def _import_peer(module: str):
    """Import a peer package lazily, with an actionable error when it is missing."""
    import importlib
    import warnings

    try:
        with warnings.catch_warnings():
            # performer_pytorch uses distutils.LooseVersion at import (peers.md §3.4)
            warnings.simplefilter("ignore", DeprecationWarning)
            return importlib.import_module(module)
    except ImportError as e:
        extra = " (performer_pytorch imports distutils: on Python >= 3.12 setuptools must be installed)" \
            if module == _PERFORMER_MODULE and "distutils" in str(e) else ""
        raise ImportError(f"peer package {module.split('.')[0]!r} is not available: {e}{extra}; {_PIP_HINT}") from e


def peer_versions() -> dict:
    """Installed versions of the peers, their dependencies, torch and Python (None = not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for pkg in _VERSION_PACKAGES:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


# ------------------------------------------------------------------------------------------------
# Peer language models
# ------------------------------------------------------------------------------------------------
class PeerLM(nn.Module):
    """A peer network behind the harness interface: ``forward(ids, mask=None) -> logits``."""

    is_peer = True

    def __init__(self, net: nn.Module, *, name: str, match: str, config: SimpleNamespace, matched_params: int,
                 notes: tuple[str, ...] = ()):
        super().__init__()
        self.net = net
        self.peer_name, self.match, self.config = name, match, config
        self.matched_params = matched_params
        self.notes = notes

    @property
    def num_params(self) -> int:
        """Parameters counted once (a tied head is not counted twice)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.net(ids) if mask is None else self.net(ids, mask=mask.bool())

    def extra_repr(self) -> str:
        return f"peer={self.peer_name!r}, match={self.match!r}, params={self.num_params}, ours={self.matched_params}"


class _GAULM(nn.Module):
    """LM from flash_pytorch modules only (embedding, ScaledSinuEmbedding, GAU blocks, LayerNorm +
    head), laid out as FLASHTransformer is; flash_pytorch ships no FLASH-Quad model."""

    def __init__(self, fp, *, dim: int, num_tokens: int, depth: int, query_key_dim: int, expansion_factor: float,
                 causal: bool, attn_dropout: float = 0.0, norm_type: str = "scalenorm"):
        super().__init__()
        norm_klass = {"scalenorm": fp.ScaleNorm, "layernorm": nn.LayerNorm}[norm_type]
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.abs_pos_emb = fp.ScaledSinuEmbedding(dim)
        self.layers = nn.ModuleList(
            fp.GAU(dim=dim, query_key_dim=query_key_dim, expansion_factor=expansion_factor, causal=causal,
                   dropout=attn_dropout, norm_klass=norm_klass) for _ in range(depth))
        self.to_logits = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, num_tokens))

    def forward(self, x, *, mask=None):
        x = self.token_emb(x)
        x = self.abs_pos_emb(x) + x
        for gau in self.layers:
            x = gau(x, mask=mask)
        return self.to_logits(x)


def _our_config(match: str, vocab_size: int | None):
    from ..presets import count_parameters, get_config

    over = {"vocab_size": vocab_size} if vocab_size else {}
    return get_config(match, **over), count_parameters(match, **over)


def _gated_options(cfg, kind: str, match: str) -> dict:
    if set(cfg.layer_types) != {kind}:
        raise ValueError(f"match={match!r} is not a {kind!r} preset (layer types {sorted(set(cfg.layer_types))})")
    return cfg.options_for(kind)


def _tie(net: nn.Module, emb: nn.Embedding, head: nn.Linear, *, align_init: bool) -> None:
    if align_init:
        nn.init.normal_(emb.weight, std=emb.embedding_dim ** -0.5)  # our LM init (modeling._init_weights)
    head.weight = emb.weight


def build_peer_model(name: str, *, seq_len: int, vocab_size: int | None = None, match: str | None = None,
                     tie_embedding: bool = True, align_init: bool = True, **kw) -> PeerLM:
    """A peer LM sized like our preset ``match`` (causal as the preset: all ``*-lm`` presets are);
    ``kw`` overrides the peer's constructor arguments (e.g. ``shift_tokens=False``,
    ``norm_type="layernorm"``, ``ff_glu=True``); our config fields (``dropout`` ...) do not apply.

    Args:
        name: one of :data:`PEER_NAMES` (``sdpa`` raises: use our ``vanilla-lm``).
        seq_len: the longest sequence the model will see (PerformerLM needs ``max_seq_len``).
        vocab_size: vocabulary (default: the preset's).
        match: our preset whose shape is copied (default :data:`DEFAULT_MATCH`).
        tie_embedding: tie the head to the token embedding, as our presets do (module docstring).
        align_init: with a tied head, initialise the embedding (and scale the absolute positions)
            as our LMs do; ignored when untied.
    """
    if name == "sdpa":
        raise ValueError("no 'sdpa' peer: our 'vanilla-lm' preset is the SDPA softmax baseline "
                         "(torch.nn.functional.scaled_dot_product_attention, peers.md §3.1); benchmark it directly")
    if name not in PEER_NAMES:
        raise ValueError(f"unknown peer {name!r}; known: {PEER_NAMES} (and 'sdpa' = our vanilla-lm)")
    match = match or DEFAULT_MATCH[name]
    cfg, ours = _our_config(match, vocab_size)
    d, V = cfg.hidden_size, cfg.vocab_size
    align = tie_embedding and align_init
    notes: list[str] = []

    if name in ("flash-pytorch", "flash-pytorch-gau"):
        fp = _import_peer(_FLASH_MODULE)
        kind = "flash" if name == "flash-pytorch" else "gau"
        opts = _gated_options(cfg, kind, match)
        args = dict(dim=d, num_tokens=V, depth=cfg.num_hidden_layers, query_key_dim=opts.get("qk_dim", 128),
                    expansion_factor=float(opts.get("expansion", 2.0)), causal=cfg.causal)
        if kind == "flash":
            args["group_size"] = opts.get("chunk_size", 256)
            args.update(kw)
            net = fp.FLASHTransformer(**args)
        else:
            args.update(kw)
            net = _GAULM(fp, **args)
        if tie_embedding:
            _tie(net, net.token_emb, net.to_logits[1], align_init=align)
        if align:
            with torch.no_grad():
                net.abs_pos_emb.scale.fill_(d ** -0.5)
    else:
        pp = _import_peer(_PERFORMER_MODULE)
        if not cfg.layer_types or set(cfg.layer_types) != {"performer"}:
            raise ValueError(f"match={match!r} is not a 'performer' preset")
        heads = cfg.num_attention_heads
        args = dict(num_tokens=V, max_seq_len=seq_len, dim=d, depth=cfg.num_hidden_layers, heads=heads,
                    dim_head=d // heads, causal=cfg.causal, ff_mult=4, ff_glu=False, qkv_bias=True,
                    attn_out_bias=True, tie_embed=tie_embedding)
        args.update(kw)
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):  # the "unable to import cuda code" notice, once per layer
            net = pp.PerformerLM(**args)
        if stdout.getvalue().strip():
            notes.append(stdout.getvalue().strip().splitlines()[0])
        net.fix_projection_matrices_()
        if align:
            nn.init.normal_(net.token_emb.weight, std=d ** -0.5)
            pos = getattr(net.pos_emb, "emb", None)
            if isinstance(pos, torch.Tensor):  # the fixed sinusoid buffer (rotary_position_emb=True)
                pos.mul_(d ** -0.5)

    config = SimpleNamespace(vocab_size=V, hidden_size=d, num_hidden_layers=cfg.num_hidden_layers,
                             max_seq_len=seq_len, match=match, tie_embedding=tie_embedding, align_init=align,
                             peer_args={k: v for k, v in args.items() if k != "num_tokens"})
    return PeerLM(net, name=name, match=match, config=config, matched_params=ours, notes=tuple(notes))


def param_counts(model: PeerLM) -> dict:
    """Parameter counts of a peer and of the preset it is matched to."""
    peer, ours = model.num_params, model.matched_params
    return {"peer": model.peer_name, "match": model.match, "peer_params": peer, "our_params": ours,
            "rel_diff": (peer - ours) / ours}


# ------------------------------------------------------------------------------------------------
# Block-level parity with flash_pytorch.GAU / FLASH
# ------------------------------------------------------------------------------------------------
_SCALENORM_EPS = 1e-30  # see module docstring (norms)


def _peer_kind(theirs) -> str:
    fp = _import_peer(_FLASH_MODULE)
    if isinstance(theirs, fp.FLASH):
        return "flash"
    if isinstance(theirs, fp.GAU):
        return "gau"
    raise TypeError(f"expected flash_pytorch.GAU or flash_pytorch.FLASH, got {type(theirs).__name__}")


def _rotary_dim(theirs) -> int | None:
    """Channels rotated by their RoPE (None: no RoPE); raises for variants ours cannot express."""
    rot = getattr(theirs, "rotary_pos_emb", None)
    if rot is None:
        return None
    if getattr(rot, "use_xpos", False) or getattr(rot, "freqs_for", "lang") != "lang" or \
            getattr(rot, "interpolate_factor", 1.0) != 1.0 or getattr(rot, "learned_freq", False):
        raise ValueError("their rotary embedding must be plain 'lang' RoPE (no xpos, interpolation, learned "
                         "frequencies) to match ours")
    return 2 * rot.freqs.numel()


def _check_matchable(theirs, kind: str) -> None:
    fp = _import_peer(_FLASH_MODULE)
    if not isinstance(theirs.attn_fn, fp.ReLUSquared):
        raise ValueError("laplace_attn_fn=True has no counterpart in ours (relu² only)")
    if kind == "flash":
        if theirs.shift_tokens:
            raise ValueError("shift_tokens=True (token shift) has no counterpart in ours; build FLASH with shift_tokens=False")
        if not theirs.causal and not theirs.reduce_group_non_causal_attn:
            raise ValueError("reduce_group_non_causal_attn=False keeps the global branch chunk-local; ours (and "
                             "the paper) sum over all chunks")
    rpb = theirs.rel_pos_bias
    if (rpb.num_buckets, rpb.max_distance) != (32, 128) or rpb.causal != theirs.causal:
        raise ValueError("their T5 bias must use 32 buckets, max distance 128 (the only setting ours has)")
    if not isinstance(theirs.norm, (nn.LayerNorm, fp.ScaleNorm)):
        raise ValueError(f"norm_klass {type(theirs.norm).__name__} has no counterpart (LayerNorm or ScaleNorm only)")


def _dims(theirs) -> tuple[int, int, int]:
    hidden = theirs.to_hidden[0]
    return hidden.in_features, hidden.out_features // 2, theirs.to_qk[0].out_features


def matching_config_kwargs(theirs, *, seq_len: int | None = None) -> dict:
    """``TransNormerConfig`` keyword arguments of a one-block model whose block computes what
    ``theirs`` (a flash_pytorch GAU or FLASH) computes. GAU needs ``seq_len`` (their 1/T)."""
    fp = _import_peer(_FLASH_MODULE)
    kind = _peer_kind(theirs)
    _check_matchable(theirs, kind)
    d, e, s = _dims(theirs)
    r = _rotary_dim(theirs) if kind == "flash" else None
    opts = {"expansion": e / d, "qk_dim": s, "rel_bias": "t5", "rope": "none" if r is None else
            ("full" if r == s else f"partial:{r}")}
    if kind == "gau":
        if seq_len is None:
            raise ValueError("flash_pytorch.GAU divides QKᵀ + bias by the tensor length T: pass seq_len=T")
        opts.update(normalizer="fixed", fixed_len=int(seq_len))
    else:
        opts.update(chunk_size=theirs.group_size, normalizer="chunk" if theirs.causal else "visible")
    if isinstance(theirs.norm, fp.ScaleNorm):
        norm_type, eps = "scale", _SCALENORM_EPS
    else:
        norm_type, eps = "layer", theirs.norm.eps
    return dict(hidden_size=d, num_hidden_layers=1, layer_types=[kind], causal=theirs.causal, norm_type=norm_type,
                norm_eps=eps, pre_norm=True, dropout=0.0, attention_dropout=0.0, layer_options={kind: opts})


def matching_block(theirs, *, seq_len: int | None = None):
    """Our ``TransNormerBlock`` (pre-norm, GAU/FLASH, residual) with ``theirs``' weights loaded,
    computing the same function (module docstring lists the conditions), in their dtype and device
    (build it from a float64 ``theirs`` to compare in float64: the bias table is scaled on load).
    Returned in eval mode."""
    from ..models.configuration import TransNormerConfig
    from ..models.modeling import TransNormerBlock

    config = TransNormerConfig(**matching_config_kwargs(theirs, seq_len=seq_len))
    block = TransNormerBlock(config, 0).to(theirs.to_out.weight if hasattr(theirs.to_out, "weight")
                                           else theirs.to_out[0].weight)  # their dtype and device
    load_flash_pytorch_weights(block, theirs, seq_len=seq_len)
    return block.eval()


def _qk_permutation(s: int, r: int | None) -> torch.Tensor:
    """perm[c] = their channel feeding our channel c: our rotate-half pair (i, i + r/2) is their
    interleaved pair (2i, 2i + 1); channels ≥ r are not rotated and keep their index."""
    perm = torch.arange(s)
    if r:
        half = r // 2
        perm[:half] = 2 * torch.arange(half)
        perm[half:r] = 2 * torch.arange(half) + 1
    return perm


@torch.no_grad()
def load_flash_pytorch_weights(ours: nn.Module, theirs: nn.Module, *, seq_len: int | None = None) -> None:
    """Copy a flash_pytorch ``GAU``/``FLASH`` into our block (``TransNormerBlock``: mixer + pre-norm)
    or bare mixer (``transnormer.layers.GAU``/``FLASH``; the norm is then the caller's).

    Checks that our configuration can reproduce theirs (T5 bias, RoPE width, normaliser, chunk
    size) and raises ValueError otherwise; see :func:`matching_config_kwargs` for the options.
    ``seq_len``: the tensor length T at which a GAU is compared (their bias is divided by T).
    """
    from ..layers.gau import FLASH as OurFLASH
    from ..layers.gau import GAU as OurGAU
    from ..modules.norms import LayerNorm, ScaleNorm

    fp = _import_peer(_FLASH_MODULE)
    kind = _peer_kind(theirs)
    _check_matchable(theirs, kind)
    mixer = getattr(ours, "mixer", ours)
    norm = getattr(ours, "mixer_norm", None)
    if norm is not None and not getattr(ours, "pre_norm", True):  # (had loaded, and computed another function)
        raise ValueError("flash_pytorch's modules are pre-norm: build our block with pre_norm=True")
    want = OurFLASH if kind == "flash" else OurGAU
    if type(mixer) is not want:
        raise TypeError(f"their {type(theirs).__name__} maps onto our {want.__name__}, got {type(mixer).__name__}")
    d, e, s = _dims(theirs)
    if (mixer.hidden_size, mixer.e, mixer.s) != (d, e, s):
        raise ValueError(f"shape mismatch: ours (d, e, s) = {(mixer.hidden_size, mixer.e, mixer.s)}, theirs {(d, e, s)}")
    if mixer.causal != theirs.causal:
        raise ValueError(f"causal mismatch: ours {mixer.causal}, theirs {theirs.causal}")
    if mixer.rel_bias.kind != "t5":
        raise ValueError("their T5 bias cannot be switched off: build ours with rel_bias='t5' (zero their "
                         "rel_pos_bias.relative_attention_bias.weight for a bias-free comparison)")
    r = _rotary_dim(theirs) if kind == "flash" else None
    our_r = None if mixer.rope is None else mixer.rope.head_dim
    if our_r != r:
        raise ValueError(f"RoPE width mismatch: ours {our_r}, theirs {r} (use rope='partial:{r}' / 'none')")
    bias_scale = theirs.rel_pos_bias.scale
    if kind == "gau":
        if seq_len is None:
            raise ValueError("flash_pytorch.GAU divides QKᵀ + bias by the tensor length T: pass seq_len=T")
        if mixer.normalizer == "seq_len":
            pass  # equal to their 1/T without padding only
        elif not (mixer.normalizer == "fixed" and mixer.fixed_len == seq_len):
            raise ValueError(f"their GAU divides by T: use normalizer='fixed', fixed_len={seq_len}")
        bias_scale = bias_scale / seq_len
    else:
        if mixer.chunk_size != theirs.group_size:
            raise ValueError(f"chunk size mismatch: ours {mixer.chunk_size}, theirs {theirs.group_size}")
        wanted = "chunk" if theirs.causal else "visible"
        if mixer.normalizer != wanted or not (mixer.local_branch and mixer.global_branch):
            raise ValueError(f"their global normaliser is {'1/C' if theirs.causal else '1/T'}: use "
                             f"normalizer={wanted!r} with both branches")

    perm = _qk_permutation(s, r)
    hid, qk = theirs.to_hidden[0], theirs.to_qk[0]
    # theirs: to_hidden → [v | gate]; ours: proj → [u (gate) | v | z]
    mixer.proj.weight.copy_(torch.cat([hid.weight[e:], hid.weight[:e], qk.weight[perm]], 0))
    mixer.proj.bias.copy_(torch.cat([hid.bias[e:], hid.bias[:e], qk.bias[perm]], 0))
    offset = theirs.offsetscale if kind == "gau" else theirs.qk_offset_scale
    order = [0, 1] if kind == "gau" else [0, 2, 1, 3]  # theirs: quad_q, lin_q, quad_k, lin_k
    mixer.gamma.copy_(offset.gamma[order][:, perm])
    mixer.beta.copy_(offset.beta[order][:, perm])
    out = theirs.to_out[0] if kind == "gau" else theirs.to_out
    mixer.out_proj.weight.copy_(out.weight)
    mixer.out_proj.bias.copy_(out.bias)
    mixer.rel_bias.t5.copy_(theirs.rel_pos_bias.relative_attention_bias.weight[:, 0] * bias_scale)
    if r:
        mixer.rope.theta.copy_(theirs.rotary_pos_emb.freqs)

    if norm is None:
        return
    if isinstance(theirs.norm, nn.LayerNorm):
        if not isinstance(norm, LayerNorm) or norm.eps != theirs.norm.eps:
            raise ValueError(f"their pre-norm is LayerNorm(eps={theirs.norm.eps}): build ours with norm_type='layer'")
        norm.weight.copy_(theirs.norm.weight)
        norm.bias.copy_(theirs.norm.bias)
    elif isinstance(theirs.norm, fp.ScaleNorm):
        if not isinstance(norm, ScaleNorm):
            raise ValueError("their pre-norm is ScaleNorm: build ours with norm_type='scale'")
        if norm.eps > 1e-20:
            raise ValueError(f"ScaleNorm ε placement differs (theirs clamps ‖x‖/√d at ε, ours adds ε inside the root): "
                             f"build ours with norm_eps={_SCALENORM_EPS} for parity, got {norm.eps}")
        norm.scale.copy_(theirs.norm.g.reshape(()))


def block_forward(block: nn.Module, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Run our ``TransNormerBlock`` like a flash_pytorch module: x [B, T, d], mask [B, T] (True = valid,
    right-padded) → [B, T, d] (residual included)."""
    from ..layers.base import default_positions

    mask = None if mask is None else mask.bool()
    out, _ = block(x, attention_mask=mask, positions=default_positions(x, mask))
    return out

