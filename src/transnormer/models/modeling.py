"""TransNormer model family: a stack of (token mixer, FFN) blocks and HF task heads.

Data: input_ids [B, T] → embeddings (+ absolute positions) → blocks → final norm → head.
Padding: ``attention_mask`` [B, T] (1 = real token), left or right padding. Left padding is
moved to the right before the blocks and moved back after them, so every layer sees its real
tokens at indices 0..L_b-1 (block and chunk boundaries then match the unpadded sequence).
Positions count real tokens, so padded and unpadded inputs give the same outputs.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    MaskedLMOutput,
    SequenceClassifierOutput,
)
from transformers.utils import can_return_tuple, logging

from ..layers import build_mixer
from ..layers.base import padding_mask
from ..modules.ffn import build_ffn
from ..modules.lm_loss import linear_cross_entropy
from ..modules.norms import LayerNorm, build_norm
from ..modules.positional import LRPE, LearnedPositions, SinusoidalPositions
from ..modules.recompute import recompute_scope, record_scope
from ..ops.rowwise import residual_add
from . import layer_builders  # noqa: F401  (registers the core layer types)
from .configuration import TransNormerConfig

logger = logging.get_logger(__name__)


def _tensors_in(obj) -> list[torch.Tensor]:
    """The tensors of a layer's cached state (a tensor, or dicts, lists and tuples of them)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors_in(o)]
    return []


_HEADED_TYPES = frozenset({"norm", "softmax", "linear_elu", "performer", "cosformer"})  # (GAU/FLASH: no heads)


def state_settings(config: TransNormerConfig) -> tuple:
    """((setting, value as JSON), ...): what the config's layer types keep while decoding depends on,
    resolved as the layer builders resolve it (a kernel left to the variant is the variant's; FLASH
    has no heads). A cache made under other values (another model of the same layer types) is
    refused by the settings that differ: it had failed deep in a layer with a shape error, or, where
    the shapes agreed (T1 against T2, another LRPE), run on to wrong outputs."""
    types = set(config.layer_types)
    values: dict = {"hidden_size": config.hidden_size}
    if types & _HEADED_TYPES:
        values["num_attention_heads"] = config.num_attention_heads
    if "norm" in types:
        values["norm_kernel"] = config.resolved("norm_kernel")
    if "diag" in types:
        values.update(diag_kernel=config.resolved("diag_kernel"), diag_norm=config.resolved("diag_norm"),
                      diag_num_attention_heads=config.diag_num_attention_heads or config.num_attention_heads,
                      block_size=config.block_size)
    if types & {"norm", "diag"}:
        values["lrpe"] = config.lrpe
    if "cosformer" in types and config.causal:  # its reweighting's M
        values["max_position_embeddings"] = config.options_for("cosformer").get("max_len",
                                                                                config.max_position_embeddings)
    for t in sorted(types):
        if config.options_for(t):
            values[f"layer_options[{t!r}]"] = config.options_for(t)
    return tuple((k, json.dumps(v, sort_keys=True, default=str)) for k, v in values.items())


@dataclass
class TransNormerCache:
    """Decoding state: one dict per layer plus the count of real tokens seen per row.

    ``layers[i]`` is whatever layer i keeps (a [B, H, e, e] state for NormAttention, at most one
    block of keys/values for DiagAttention, a KV cache for softmax attention ...).
    """

    layers: list
    seen: torch.Tensor | None = None  # [B] real tokens so far
    length: int = 0  # tokens (real or padding) consumed so far
    layer_types: tuple | None = None  # the model's, to refuse a cache made by another model
    settings: tuple | None = None  # the model's state_settings: another model of the same layer types is refused
    dtype: str | None = None  # the model's parameter dtype when the cache was made (a model cast since: explained)

    # What transformers' generate() reads on a cache passed in (a continuation, a cached prefix):
    # not a static cache to compile for, and, for its input slicing, a cache that counts tokens
    # (``get_seq_length``) as a key/value cache does.
    is_compileable = False
    # Not croppable: NormAttention's state sums every token so far (transformers' own linear-attention
    # caches say the same; 5.24 reads it on MPS, and it had been an AttributeError there).
    is_croppable = False

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.layers)

    @classmethod
    def empty(cls, num_layers: int, layer_types=None) -> TransNormerCache:
        return cls(layers=[None] * num_layers, layer_types=None if layer_types is None else tuple(layer_types))

    @classmethod
    def for_config(cls, config: TransNormerConfig, dtype: torch.dtype | None = None) -> TransNormerCache:
        """An empty cache that a model of other layer types or other state settings refuses; its
        ``dtype`` (the model's parameters') explains a failure after the model was cast since."""
        return cls(layers=[None] * config.num_hidden_layers, layer_types=tuple(config.layer_types),
                   settings=state_settings(config), dtype=None if dtype is None else str(dtype))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """Refused: a state that sums every token cannot be cut back to an earlier one."""
        raise ValueError("this cache cannot be cropped: NormAttention keeps one [B, H, e, e] sum over all tokens "
                         "so far; run the prefix again instead")

    def activate_past_recording(self, **kwargs) -> None:
        """Asked by transformers >= 5.25's assisted decoding (assistant_model, prompt_lookup_num_tokens),
        which rolls a cache back over rejected draft tokens; 5.24 refused it through ``_is_stateful``."""
        raise ValueError("assisted decoding needs a cache it can cut back to an earlier token; this model's is "
                         "stateful (NormAttention keeps one [B, H, e, e] sum over all tokens so far): generate "
                         "without assistant_model / prompt_lookup_num_tokens")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> TransNormerCache:
        """Select rows (beam search)."""
        return self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> TransNormerCache:
        """Each row ``repeats`` times in a row (generate()'s beams or return sequences from a cache
        passed in, as HF's caches do)."""
        return self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def _map_rows(self, fn) -> TransNormerCache:
        def rows(obj):
            if isinstance(obj, torch.Tensor):
                return fn(obj)
            if isinstance(obj, dict):
                return {k: rows(v) for k, v in obj.items()}
            return obj

        self.layers = [rows(c) for c in self.layers]
        self.seen = None if self.seen is None else rows(self.seen)
        return self


def _fp32_unless_autocast(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits of a half-precision model are upcast for the loss; under autocast the
    loss is already computed in fp32 without a materialised copy."""
    if logits.dtype in (torch.float16, torch.bfloat16) and not torch.is_autocast_enabled(logits.device.type):
        return logits.float()
    return logits


class TransNormerBlock(nn.Module):
    """Pre-norm: x += Drop(Mix(N(x))); x += Drop(FFN(N(x))). Post-norm: x = N(x + Drop(Mix(x))) ..."""

    def __init__(self, config: TransNormerConfig, layer_idx: int):
        super().__init__()
        self.pre_norm = config.pre_norm
        d = config.hidden_size
        self.mixer = build_mixer(config, layer_idx)
        # pre-norm: the norms' outputs only feed the mixer's and the FFN's products (not the residual)
        self.mixer_norm = build_norm(config.norm_type, d, eps=config.norm_eps, eps_inside_sqrt=config.eps_inside_sqrt,
                                     feeds_autocast=config.pre_norm)
        self.ffn = None
        if not self.mixer.replaces_ffn:
            self.ffn = build_ffn(config.ffn_type, d, config.ffn_hidden_size, config.ffn_act)
            self.ffn_norm = build_norm(config.norm_type, d, eps=config.norm_eps, eps_inside_sqrt=config.eps_inside_sqrt,
                                       feeds_autocast=config.pre_norm)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, *, attention_mask, positions, cache=None, use_cache=False):
        kw = {"attention_mask": attention_mask, "positions": positions, "cache": cache, "use_cache": use_cache}
        if self.pre_norm:
            h, cache = self.mixer(self.mixer_norm(x, attention_mask), **kw)
            x = residual_add(x, self.dropout(h))  # fused on CPU for an fp32 stream (ops/rowwise.py)
            if self.ffn is not None:
                x = residual_add(x, self.dropout(self.ffn(self.ffn_norm(x, attention_mask))))
        else:
            h, cache = self.mixer(x, **kw)
            x = self.mixer_norm(x + self.dropout(h), attention_mask)
            if self.ffn is not None:
                x = self.ffn_norm(x + self.dropout(self.ffn(x)), attention_mask)
        return x, cache


class TransNormerPreTrainedModel(PreTrainedModel):
    config_class = TransNormerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    # HF Trainer passes num_items_in_batch (the targets of all the step's micro-batches) and the
    # heads return their summed loss over it: each target weighs the same whatever micro-batch it
    # is in (a per-batch mean had let a batch of 2 targets weigh as much as one of 12).
    accepts_loss_kwargs = True
    _no_split_modules = ["TransNormerBlock"]

    def _init_weights(self, module: nn.Module) -> None:
        cfg = self.config
        if isinstance(module, LRPE):
            # θ and u are computed, not drawn through torch.nn.init (which HF guards while it loads
            # a checkpoint): the ones the checkpoint held keep their flag, the others are computed
            module.reset_parameters(keep=lambda t: getattr(t, "_is_hf_initialized", False))
            return
        if isinstance(module, TransNormerLMHead):
            # its own output bias, a bare Parameter no branch below reaches: from_pretrained leaves
            # a head the checkpoint lacks (an encoder loaded as a masked LM) as torch.empty
            nn.init.zeros_(module.bias)
        if cfg.initializer == "normal":  # RoBERTa: N(0, 0.02²) weights, zero biases, unit LayerNorms
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=cfg.initializer_range)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                if module.elementwise_affine:
                    nn.init.ones_(module.weight)
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)
            # The other tensors keep their module's own init: γ/β, relative biases, features, norms'
            # gains and positions (which from_pretrained had left as torch.empty where the checkpoint
            # lacked them), not the layer's linears, drawn above.
            elif hasattr(module, "reset_own_parameters"):
                module.reset_own_parameters()
            elif hasattr(module, "reset_parameters") and next(module.children(), None) is None:
                module.reset_parameters()
            return
        if isinstance(module, nn.Embedding):  # fairseq LM: N(0, d^-1/2)
            nn.init.normal_(module.weight, std=module.embedding_dim ** -0.5)
        elif isinstance(module, (nn.Linear, nn.LayerNorm)):
            # from_pretrained leaves weights a checkpoint lacks uninitialised and relies on this call:
            # a new classification head gets PyTorch's default; a linear of a layer the checkpoint
            # lacks (a deeper model, another layer type) gets its layer's own init (NormAttention's
            # xavier gains, zero output bias), which HF would not ask for: a layer without direct
            # parameters counts as initialised. torch.nn.init is guarded while HF loads, so the
            # layer's weights that the checkpoint held stay as loaded. A layer is reset once, at its
            # first linear HF asks for, all its own linears with it (HF's mark then skips the rest).
            owners = self._layer_owners()
            owner = owners.get(id(module))
            if owner is None:
                module.reset_parameters()
            elif not getattr(owner, "_is_hf_initialized", False):
                for part in owner.modules():
                    if owners.get(id(part)) is owner:
                        part.reset_parameters()
                owner.reset_parameters()
                owner._is_hf_initialized = True
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()  # layers own the released code's init

    def _layer_owners(self) -> dict:
        """id of each linear and layer norm inside a module that initialises it itself -> that module
        (the innermost)."""
        owners = {}
        for m in self.modules():  # outer modules first: an inner owner overwrites
            if m is not self and hasattr(m, "reset_parameters") and not isinstance(
                    m, (nn.Linear, nn.LayerNorm, nn.Embedding)):
                owners.update({id(c): m for c in m.modules() if isinstance(c, (nn.Linear, nn.LayerNorm))})
        return owners


def _check_position_ids(position_ids, positions: torch.Tensor, mask: torch.Tensor | None) -> None:
    """Accept HF ``position_ids`` only where they say what the model derives itself (the count of
    real tokens before each, after the cache): other positions (e.g. packed sequences restarting
    at 0) would need attention across rows' segments that the mixers do not model."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.is_floating_point():
        raise ValueError(f"position_ids must be an integer [B, T] tensor, got {getattr(position_ids, 'shape', position_ids)}")
    try:
        given = position_ids.to(positions.device).expand_as(positions)
    except RuntimeError:
        raise ValueError(f"position_ids must be [B, T] = {tuple(positions.shape)}, got {tuple(position_ids.shape)}") from None
    real = torch.ones_like(positions, dtype=torch.bool) if mask is None else mask
    if not torch.equal(torch.where(real, given, 0), torch.where(real, positions, 0)):
        raise ValueError("position_ids must count the real tokens before each token (after the cache), as the "
                         "model derives them from attention_mask; other positions (e.g. packed sequences) are not "
                         "supported: omit position_ids")


class TransNormerModel(TransNormerPreTrainedModel):
    def __init__(self, config: TransNormerConfig):
        super().__init__(config)
        config.check()
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d, padding_idx=None)
        self.embed_scale = math.sqrt(d) if config.scale_embedding else 1.0
        if config.abs_pos == "sinusoidal":
            self.embed_positions = SinusoidalPositions(d)
        elif config.abs_pos == "scaled_sinusoid":
            alpha0 = d ** -0.5 if config.abs_pos_scale is None else float(config.abs_pos_scale)  # flash.md §1.3
            self.embed_positions = SinusoidalPositions(d, learnable_scale=alpha0, layout="transformer")
        elif config.abs_pos == "learned":
            self.embed_positions = LearnedPositions(config.max_position_embeddings, d)
        else:
            self.embed_positions = None
        self.embed_norm = LayerNorm(d) if config.embed_norm else None  # (fp32 for half inputs: modules.norms)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(TransNormerBlock(config, i) for i in range(config.num_hidden_layers))
        self.gradient_checkpointing = False  # HF activation_checkpointing_enable() turns it on
        self._accepted_settings = None  # the last cache's state settings found to be this model's
        self.final_norm = (
            build_norm(config.norm_type, d, eps=config.norm_eps, eps_inside_sqrt=config.eps_inside_sqrt)
            if config.final_norm else None
        )
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: TransNormerCache | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: TransNormerCache | None = None,
        output_attentions: bool | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """``return_dict=False`` (or ``config.return_dict = False``) returns the output's tuple;
        ``output_hidden_states`` defaults to ``config.output_hidden_states``."""
        if output_attentions is None:  # (HF's convention: the config's when not given; it had been ignored)
            output_attentions = self.config.output_attentions
        if output_attentions:
            raise ValueError("output_attentions=True is not supported: the linear mixers never form an attention "
                             "matrix; transnormer.analysis.attention_map(layer, x) computes one for analysis")
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if input_ids is not None:
            if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
                raise ValueError(f"input_ids must be a [B, T] tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
            if input_ids.dtype not in (torch.int64, torch.int32):  # (the embedding's index types)
                raise TypeError(f"input_ids must be an int64 or int32 tensor of token ids, got {input_ids.dtype}")
            check_token_ids(input_ids, self.embed_tokens.num_embeddings)
            x = self.embed_tokens(input_ids)
        else:
            d = self.config.hidden_size
            if (not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != d
                    or not inputs_embeds.is_floating_point()):
                raise ValueError(f"inputs_embeds must be a floating-point [B, T, hidden_size={d}] tensor, got "
                                 f"{getattr(inputs_embeds, 'dtype', type(inputs_embeds))} "
                                 f"{tuple(getattr(inputs_embeds, 'shape', ()))}")
            want = self.embed_tokens.weight.dtype
            if inputs_embeds.dtype != want and (torch.float64 in (inputs_embeds.dtype, want)
                                                or not torch.is_autocast_enabled(inputs_embeds.device.type)):
                # (autocast casts the products' fp32/half operands, never fp64; without it, or for
                # fp64, the first product met two dtypes)
                raise TypeError(f"inputs_embeds must have the model's dtype {want}, got {inputs_embeds.dtype} "
                                "(cast it, or the model with .to(dtype))")
            x = inputs_embeds
        x = x * self.embed_scale
        B, T = x.shape[:2]
        if cache is None:
            cache = past_key_values  # the pre-v5 name
        if use_cache is None:
            # As HF models: config.use_cache. Not in training mode (a training step never decodes and
            # would only pay for the states), but always when a cache is given to continue.
            use_cache = cache is not None or (self.config.use_cache and self.config.causal and not self.training
                                              and all(layer.mixer.decodes for layer in self.layers))
        use_cache = bool(use_cache)
        if use_cache and cache is None and self.gradient_checkpointing and self.training:
            # as HF's models: the blocks had run without checkpointing (all activations kept), silently
            logger.warning_once("use_cache=True is incompatible with gradient checkpointing in training: "
                                "setting use_cache=False")
            use_cache = False
        if use_cache and not self.config.causal:
            raise ValueError("use_cache=True needs a causal model (config.causal=True)")
        if cache is not None and not isinstance(cache, TransNormerCache):
            raise TypeError(f"cache must be a TransNormerCache, got {type(cache).__name__}")
        if use_cache and cache is None:
            cache = TransNormerCache.for_config(self.config, self.dtype)
        if cache is not None and (len(cache.layers) != len(self.layers) or cache.layer_types not in (
                None, tuple(self.config.layer_types))):
            # (another model's cache had run on: a FLASH layer took a NormAttention state for none)
            raise ValueError(f"cache: made by another model ({len(cache.layers)} layers, types "
                             f"{list(cache.layer_types or [])}); this one has {len(self.layers)}: "
                             f"{list(self.config.layer_types)}")
        if cache is not None and cache.settings is not None and cache.settings is not self._accepted_settings:
            # (once per cache: a decode step carries the same tuple on, and computing the settings took
            # 60-90 us, ~1% of a small model's step)
            ours = state_settings(self.config)
            if cache.settings != ours:
                ours, theirs = dict(ours), dict(cache.settings)
                differ = [f"{k} {theirs.get(k, 'unset')} (this model: {ours.get(k, 'unset')})"
                          for k in dict.fromkeys([*theirs, *ours]) if theirs.get(k) != ours.get(k)]
                raise ValueError(f"cache: made by another model with the same layer types but other settings: "
                                 f"{'; '.join(differ)}")
            self._accepted_settings = cache.settings
        decoding = cache is not None and cache.seen is not None
        if decoding and cache.seen.shape[0] != B:
            raise ValueError(f"the cache holds {cache.seen.shape[0]} rows but the input has B = {B}")
        # A cache passed with use_cache=False is read, not advanced (as in Hugging Face models): the
        # layers step a copy of it and no cache is returned.
        step_layers = use_cache or decoding
        if decoding and not use_cache:
            cache = TransNormerCache(layers=list(cache.layers), seen=cache.seen, length=cache.length,
                                     layer_types=cache.layer_types, settings=cache.settings, dtype=cache.dtype)

        mask = None
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor):
                raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
            # HF passes past + current columns while decoding; otherwise the mask is exactly [B, T]
            width = T + (cache.length if decoding else 0)
            # (two comparisons, not `in (T, width)`: under torch.compile with a dynamic T, dynamo's
            # containment test compared the mask's constant width with symbols as unequal)
            if (attention_mask.dim() != 2 or attention_mask.shape[0] != B
                    or (attention_mask.shape[1] != T and attention_mask.shape[1] != width)):
                want = f"[B, T] = {(B, T)}" + (f" or [B, past + T] = {(B, width)}" if decoding else "")
                raise ValueError(f"attention_mask must be {want}, got {tuple(attention_mask.shape)}")
            mask = padding_mask(attention_mask[:, -T:])  # HF passes past + current columns while decoding
        prefix = cache.seen if decoding else torch.zeros(B, dtype=torch.long, device=x.device)
        if mask is None:
            positions = prefix[:, None] + torch.arange(T, device=x.device)
        else:
            positions = prefix[:, None] + (mask.long().cumsum(-1) - 1).clamp_min(0)
        if position_ids is not None:
            _check_position_ids(position_ids, positions, mask)

        gather = None
        if mask is not None and not decoding:
            first = mask.long().argmax(1)  # index of the first real token (0 for empty rows)
            if bool(first.any()):
                idx = (torch.arange(T, device=x.device) + first[:, None]) % T
                gather = idx
                x = x.gather(1, idx[:, :, None].expand_as(x))
                mask, positions = mask.gather(1, idx), positions.gather(1, idx)
            if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
                raise ValueError("attention_mask must be left- or right-padded: real tokens must be contiguous")
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions, x.dtype).to(x.dtype)  # (fp64 models: an fp64 table)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x = self.dropout(x)

        hidden_states = [] if output_hidden_states else None
        # The layers' new states are committed together after the last layer: an error in a later
        # layer leaves the caller's cache as it was, not advanced in its first layers only.
        new_layers = list(cache.layers) if step_layers else None
        for i, layer in enumerate(self.layers):
            if hidden_states is not None:
                hidden_states.append(x)
            layer_cache = cache.layers[i] if cache is not None else None
            if self.gradient_checkpointing and self.training and not step_layers:
                # Keep only each block's input; recompute its activations in the backward.
                x, new_layer_cache = self._checkpoint(layer, x, mask, positions)
            else:
                try:
                    x, new_layer_cache = layer(x, attention_mask=mask, positions=positions, cache=layer_cache,
                                               use_cache=step_layers)
                except (RuntimeError, ValueError) as e:
                    if not isinstance(e, torch.OutOfMemoryError):
                        self._explain_cast_since(cache, layer_cache, i, e)
                    raise
            if step_layers:
                new_layers[i] = new_layer_cache
        if self.final_norm is not None:
            x = self.final_norm(x, mask)
        if hidden_states is not None:
            hidden_states.append(x)
        if gather is not None:  # move left padding back where the caller had it
            inv = (torch.arange(T, device=x.device) - first[:, None]) % T
            x = x.gather(1, inv[:, :, None].expand_as(x))
            if hidden_states is not None:
                hidden_states = [h.gather(1, inv[:, :, None].expand_as(h)) for h in hidden_states]
        if use_cache:
            cache.layers = new_layers
            cache.seen = prefix + (T if mask is None else mask.long().sum(1))
            cache.length += T
        return BaseModelOutputWithPast(
            last_hidden_state=x,
            cache=cache if use_cache else None,
            hidden_states=tuple(hidden_states) if hidden_states is not None else None,
        )

    def _explain_cast_since(self, cache, layer_cache, i: int, error: Exception) -> None:
        """Raise a ValueError that says why layer ``i`` failed on ``cache`` when the model was cast to
        another dtype after the cache was made (its states in the old dtype; a layer had failed with
        "expected scalar type Float but found BFloat16"). Nothing for other errors, or a cache that
        did not record its dtype."""
        if layer_cache is None or cache.dtype is None or cache.dtype == str(self.dtype):
            return
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in _tensors_in(layer_cache) if t.is_floating_point()})
        raise ValueError(f"cache: made when the model was {cache.dtype.removeprefix('torch.')}, its states in "
                         f"{', '.join(dtypes)}; the model is {str(self.dtype).removeprefix('torch.')} now: layer {i} "
                         f"failed on it ({type(error).__name__}: {error}); make the cache again") from error

    def _checkpoint(self, layer, x, mask, positions):
        from torch.utils.checkpoint import checkpoint

        if any(getattr(m, "has_call_state", False) for m in layer.modules()):
            calls, remembered = 0, {}

            def run(x):
                nonlocal calls
                calls += 1  # the second call is the backward's recomputation: no side effects again,
                # and the state the first call used (modules/recompute.py)
                with recompute_scope(remembered) if calls > 1 else record_scope(remembered):
                    return layer(x, attention_mask=mask, positions=positions)[0]
        else:
            # nothing to keep from running twice: a pure function, which torch.compile traces into
            # the checkpoint (the counter and scopes had made it run every block eagerly)
            def run(x):
                return layer(x, attention_mask=mask, positions=positions)[0]

        # HF's activation_checkpointing_enable(kwargs, offload=...) sets the function to call (its
        # options had been ignored); without it, non-reentrant torch checkpointing
        fn = getattr(self, "_gradient_checkpointing_func", None)
        return (fn(run, x) if fn is not None else checkpoint(run, x, use_reentrant=False)), None


class TransNormerForCausalLM(TransNormerPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # NormAttention's state cannot be cut back to an earlier token: generate() then refuses
    # assisted decoding with a clear error instead of failing inside it.
    _is_stateful = True

    def __init__(self, config: TransNormerConfig):
        super().__init__(config)
        if not config.causal:  # every position would see the tokens it is trained to predict
            raise ValueError("TransNormerForCausalLM needs a causal config (causal=True)")
        self.model = TransNormerModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        inputs_embeds=None,
        labels=None,
        cache=None,
        use_cache=None,
        output_hidden_states=None,
        return_dict=None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values=None,
        return_logits: bool = True,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """``return_logits=False`` with ``labels``: the loss comes from the fused chunked head
        (modules/lm_loss.py) and ``logits`` is None — the [B, T, V] logits are never stored."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                         cache=cache if cache is not None else past_key_values, use_cache=use_cache,
                         output_hidden_states=output_hidden_states, output_attentions=kwargs.get("output_attentions"),
                         position_ids=kwargs.get("position_ids"), return_dict=True)
        h = out.last_hidden_state
        if labels is not None:
            labels = check_labels(labels, h.shape[:2])
        if isinstance(logits_to_keep, torch.Tensor) or logits_to_keep:
            if labels is not None:
                raise ValueError("logits_to_keep drops positions the labels score; pass one or the other")
            # HF: an int keeps the last n positions, a 1-D tensor the positions it lists
            h = h[:, logits_to_keep] if isinstance(logits_to_keep, torch.Tensor) else h[:, -logits_to_keep:]
        logits = loss = None
        # Shift the labels, not the logits: slicing [B, T, V] logits copies them (and their gradient).
        shifted = None if labels is None else F.pad(labels[:, 1:], (0, 1), value=-100)
        given = shifted  # the targets as HF Trainer counts them (labels[:, 1:] other than -100)
        if shifted is not None and attention_mask is not None:
            # A target is scored only from a real position to a real token: left padding's last pad
            # would otherwise predict the first real token (from a state that has seen the whole
            # row: the model runs left padding on the right), and right padding's first pad be a target.
            real = padding_mask(attention_mask[:, -labels.shape[1]:])
            shifted = shifted.masked_fill(~(real & F.pad(real[:, 1:], (0, 1), value=False)), -100)
        if shifted is not None and not return_logits:  # (linear_cross_entropy checks the targets' range itself)
            loss = linear_cross_entropy(h.reshape(-1, h.shape[-1]), self.lm_head.weight, shifted.reshape(-1))
        else:
            logits = self.lm_head(h)
            if shifted is not None:
                check_targets(shifted, self.config.vocab_size)
                loss = F.cross_entropy(_fp32_unless_autocast(logits).reshape(-1, logits.shape[-1]),
                                       shifted.reshape(-1), ignore_index=-100)
        if loss is not None:
            loss = over_items(loss, lambda: (shifted != -100).sum(), kwargs.get("num_items_in_batch"),
                              given=lambda: (given != -100).sum())
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache, hidden_states=out.hidden_states)

    # Generation ------------------------------------------------------------------------------
    def generate(self, inputs: torch.Tensor | None = None, *args, **kwargs):
        """GenerationMixin's, with an empty prompt refused by name at any batch size (with B > 1
        transformers' right-padding check indexed its last column first: an IndexError)."""
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == 0
                and kwargs.get("inputs_embeds") is None):
            raise ValueError("generate() needs a prompt of at least one token (e.g. the bos or eos id)")
        return super().generate(inputs, *args, **kwargs)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # our layers keep recurrent states, not HF key/value caches

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """generate()'s cache set-up, plus an empty TransNormerCache up front: chunked prefill
        (``prefill_chunk_size``) needs a cache before its first chunk, and HF makes none for
        models without key/value caches."""
        given = model_kwargs.get("cache") is not None or model_kwargs.get("past_key_values") is not None
        if given and generation_config.use_cache is False:
            # HF feeds the whole sequence each step without a cache, and a given prefix cache would be
            # read under it every time: the prefix counted twice
            raise ValueError("generate() with a cache needs use_cache=True (without it every step re-reads "
                             "the whole sequence on top of the cached prefix)")
        if not given and generation_config.use_cache is not False and not all(
                layer.mixer.decodes for layer in self.model.layers):
            # as forward's own default: a model whose layers cannot decode step by step (e.g. GAU with
            # normalizer="seq_len") generates by re-reading the whole sequence each step
            logger.warning_once("generate(): a layer of this model cannot decode with a cache; each step "
                                "re-reads the whole sequence (use_cache=False)")
            generation_config.use_cache = False
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if (generation_config.use_cache is not False and model_kwargs.get("cache") is None
                and model_kwargs.get("past_key_values") is None):
            model_kwargs["cache"] = TransNormerCache.for_config(self.config, self.dtype)

    def _expand_inputs_for_generation(self, expand_size: int = 1, is_encoder_decoder: bool = False, input_ids=None,
                                      **model_kwargs):
        """As GenerationMixin's, and a cache passed in is expanded too (beams or return sequences from
        a cached prefix had failed: the cache held B rows, the input B x expand_size)."""
        input_ids, model_kwargs = super()._expand_inputs_for_generation(expand_size, is_encoder_decoder, input_ids,
                                                                        **model_kwargs)
        if expand_size > 1:
            for key in ("cache", "past_key_values"):
                if isinstance(model_kwargs.get(key), TransNormerCache):
                    model_kwargs[key] = model_kwargs[key].batch_repeat_interleave(expand_size)
        return input_ids, model_kwargs

    def prepare_inputs_for_generation(self, input_ids, cache=None, attention_mask=None, inputs_embeds=None,
                                      use_cache=True, past_key_values=None, **kwargs):
        """Feed only the tokens the cache has not seen; create the cache on the first call."""
        cache = cache if cache is not None else past_key_values
        if use_cache and cache is None:
            cache = TransNormerCache.for_config(self.config, self.dtype)
        inputs = {"attention_mask": attention_mask, "cache": cache, "use_cache": use_cache}
        # As transformers' own default: generate() says how many trailing positions the cache has not
        # seen (next_sequence_length); None means all of them (the first call, new ids passed alone
        # with a cache, a chunk of a chunked prefill). A prompt given as embeddings is read at the
        # first iteration only; after it the ids hold the generated tokens.
        n = kwargs.get("next_sequence_length")
        name, given = (("inputs_embeds", inputs_embeds) if inputs_embeds is not None and kwargs.get("is_first_iteration")
                       else ("input_ids", input_ids))
        inputs[name] = given[:, given.shape[1] - n:] if n is not None else given
        if inputs[name].shape[1] == 0:  # HF would then index the logits of no token
            if given.shape[1] == 0:
                raise ValueError("generate() needs a prompt of at least one token (e.g. the bos or eos id)")
            raise ValueError(f"generate(): the cache has already seen all {given.shape[1]} tokens of the prompt; "
                             "give it a cache of all but the last prompt token (the next token is predicted from "
                             "that token's logits)")
        # the rest (output_hidden_states, logits_to_keep, ...) reaches forward as generate() set it
        internal = ("next_sequence_length", "is_first_iteration", "labels", "position_ids", "cache_position",
                    "return_dict")
        inputs.update({k: v for k, v in kwargs.items() if k not in internal and k not in inputs and v is not None})
        return inputs


class TransNormerLMHead(nn.Module):
    """RoBERTa-style MLM head: dense, GELU, LayerNorm, tied decoder with bias."""

    def __init__(self, config: TransNormerConfig):
        super().__init__()
        d = config.hidden_size
        self.dense = nn.Linear(d, d)
        self.norm = LayerNorm(d)  # (in fp32 for half inputs: modules.norms)
        self.decoder = nn.Linear(d, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, x):
        return self.decoder(self.norm(F.gelu(self.dense(x)))) + self.bias


class TransNormerForMaskedLM(TransNormerPreTrainedModel):
    _tied_weights_keys = {"lm_head.decoder.weight": "model.embed_tokens.weight"}

    def __init__(self, config: TransNormerConfig):
        super().__init__(config)
        if config.causal:
            raise ValueError("TransNormerForMaskedLM needs a bidirectional config (causal=False)")
        self.model = TransNormerModel(config)
        self.lm_head = TransNormerLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, value):
        self.lm_head.decoder = value

    def resize_token_embeddings(self, *args, **kwargs) -> nn.Embedding:
        """HF's resize, plus the head's own output bias (HF resizes only a bias inside the decoder):
        kept for the ids that stay, zero for new ones."""
        emb = super().resize_token_embeddings(*args, **kwargs)
        old, n = self.lm_head.bias, emb.num_embeddings
        if old.shape[0] != n:
            new = old.detach().new_zeros(n)
            keep = min(n, old.shape[0])
            new[:keep] = old.detach()[:keep]
            self.lm_head.bias = nn.Parameter(new, requires_grad=old.requires_grad)
        return emb

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None,
                output_hidden_states=None, return_dict=None, return_logits: bool = True, **kwargs) -> MaskedLMOutput:
        """``return_logits=False`` with ``labels``: the head runs on the masked positions only (about
        15% of the tokens) and ``logits`` is None."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                         use_cache=False,  # a causal encoder under a head never decodes
                         position_ids=kwargs.get("position_ids"),  # checked there: only what the model derives
                         output_hidden_states=output_hidden_states, output_attentions=kwargs.get("output_attentions"),
                         return_dict=True)
        h = out.last_hidden_state
        if labels is not None:
            labels = check_labels(labels, h.shape[:2])
            given = labels  # as HF Trainer counts them
            if attention_mask is not None:  # a padded position is never a target, whatever its label
                labels = labels.masked_fill(~padding_mask(attention_mask), -100)
            check_targets(labels, self.config.vocab_size)
        if labels is not None and not return_logits:
            picked = labels.reshape(-1) != -100
            sel = self.lm_head(h.reshape(-1, h.shape[-1])[picked])
            loss = F.cross_entropy(_fp32_unless_autocast(sel), labels.reshape(-1)[picked])
            loss = over_items(loss, picked.sum, kwargs.get("num_items_in_batch"), given=lambda: (given != -100).sum())
            return MaskedLMOutput(loss=loss, logits=None, hidden_states=out.hidden_states)
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(_fp32_unless_autocast(logits).reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=-100)
            loss = over_items(loss, lambda: (labels != -100).sum(), kwargs.get("num_items_in_batch"),
                              given=lambda: (given != -100).sum())
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None, mode: str) -> torch.Tensor:
    """[B, T, d] → [B, d]: mean over real tokens, the first token, or the last real token."""
    B, T, _ = hidden.shape
    mask = (torch.ones(B, T, dtype=torch.bool, device=hidden.device) if attention_mask is None
            else padding_mask(attention_mask))
    if mode == "mean":
        # summed in fp32 at least: an fp16 sum over T = 4096 overflows once the mean passes 16 (fp64 stays fp64)
        summed = (hidden * mask[:, :, None].to(hidden.dtype)).sum(1, dtype=torch.promote_types(hidden.dtype,
                                                                                              torch.float32))
        return (summed / mask.sum(1, keepdim=True).clamp_min(1)).to(hidden.dtype)
    idx = torch.arange(T, device=hidden.device).expand(B, T)
    if mode == "first":
        pos = torch.where(mask, idx, T).amin(1).clamp_max(T - 1)
    elif mode == "last":
        pos = torch.where(mask, idx, -1).amax(1).clamp_min(0)
    else:
        raise ValueError(f"pooling must be 'mean', 'first' or 'last', got {mode!r}")
    return hidden[torch.arange(B, device=hidden.device), pos]


class TransNormerForSequenceClassification(TransNormerPreTrainedModel):
    def __init__(self, config: TransNormerConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = TransNormerModel(config)
        d = config.hidden_size
        p = config.classifier_dropout if config.classifier_dropout is not None else config.dropout
        self.classifier = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Dropout(p), nn.Linear(d, config.num_labels))
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None,
                output_hidden_states=None, return_dict=None, **kwargs) -> SequenceClassifierOutput:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                         use_cache=False,  # a causal encoder under a head never decodes
                         position_ids=kwargs.get("position_ids"),  # checked there: only what the model derives
                         output_hidden_states=output_hidden_states, output_attentions=kwargs.get("output_attentions"),
                         return_dict=True)
        logits = self.classifier(pool(out.last_hidden_state, attention_mask, self.config.classifier_pooling))
        loss = None if labels is None else head_loss(self.config, logits, labels, kwargs.get("num_items_in_batch"))
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)


def head_loss(config: TransNormerConfig, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None):
    """A classification head's loss (one tower or two): ``config.problem_type`` inferred from the first
    labels and kept, as HF's heads do (pipelines read it), then :func:`classification_loss` over the
    labels it scores, or their sum over Trainer's ``num_items_in_batch`` (:func:`over_items`)."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if config.problem_type is None:
        config.problem_type = infer_problem_type(logits, labels)
    loss = classification_loss(logits, labels, config.problem_type)
    return over_items(loss, scored_labels(labels, config.problem_type), num_items_in_batch)


def scored_labels(labels: torch.Tensor, problem_type: str):
    """The count of labels a classification loss averaged over (a callable, for over_items): the
    cross-entropy skips -100, as HF Trainer's num_items_in_batch does; the others score them all."""
    if problem_type == "single_label_classification":
        return lambda: (labels != -100).sum()
    return labels.numel


def check_token_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError unless every id is in [0, vocab_size). Without the check an id out of range
    is an IndexError deep in the embedding on CPU, and on CUDA a device-side assert that leaves the
    context unusable. Skipped while torch.compile traces (a data-dependent branch)."""
    if ids.numel() == 0 or torch.compiler.is_compiling():
        return
    lo, hi = torch.stack(ids.aminmax()).tolist()  # one device sync
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"input_ids must be token ids in [0, vocab_size={vocab_size}), got ids from {lo} to {hi} "
                         "(a tokenizer with more tokens than the model? see resize_token_embeddings)")


def check_labels(labels, shape) -> torch.Tensor:
    """``labels`` as int64, after raising unless it is an integer tensor of the tokens' ``shape`` [B, T]
    (-100: not scored). Any integer dtype is taken, as for input_ids: int32 labels had failed inside
    cross_entropy, uint8 in the -100 fill."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor of token ids (-100: not scored), got {labels.dtype}")
    if tuple(labels.shape) != tuple(shape):
        raise ValueError(f"labels must have the tokens' shape [B, T] = {list(shape)}, got {list(labels.shape)}")
    return labels.long()


def check_targets(targets: torch.Tensor, vocab_size: int) -> None:
    """Raise unless every scored target (after the shift and the padding mask: a padded position's
    label is never read, whatever it is) is a token id in [0, vocab_size) or -100. An id past the
    vocabulary had been an IndexError from the loss."""
    bad = (targets != -100) & ((targets < 0) | (targets >= vocab_size))
    if targets.device.type != "meta" and bool(bad.any()):
        raise ValueError(f"labels must lie in [0, {vocab_size}) or equal -100 (not scored), got "
                         f"{int(targets[bad][0])}")


def over_items(mean_loss: torch.Tensor, count, num_items_in_batch, given=None) -> torch.Tensor:
    """``mean_loss`` over ``count()`` targets as their sum over ``num_items_in_batch`` (HF Trainer's
    count of the step's targets over its accumulated micro-batches: labels other than -100, after the
    causal shift); unchanged when that is None. ``count`` is called only then: a plain training step
    does not count. Trainer's count must be of the targets the head scores: a collator gives padding
    the label -100 (HF's do); the heads never score a padded position, whatever its label.

    ``given()``: the micro-batch's labels as Trainer counts them. Where it exceeds ``count()`` the
    step's loss reads low by the labels' share that no head scores (HF's collators, left-padding,
    keep the first real token's label, which the causal head does not score from the pad before
    it), and a warning says so: the count is of the whole step, so the head cannot correct it."""
    if num_items_in_batch is None:
        return mean_loss
    n = count()
    if given is not None and int(given()) > int(n):  # (one message, so that Python shows it once)
        warnings.warn("num_items_in_batch counts labels of this batch that the head does not score (a "
                      "padded position, or the first real token after left padding, which the causal head never "
                      "predicts from the pad before it), so the loss is their sum over too large a count: give "
                      "them the label -100 in the collator, or pad on the right", UserWarning, stacklevel=2)
    if int(n) == 0:  # the mean of nothing is NaN; the sum is 0 (and its gradient)
        return mean_loss.nan_to_num(0.0) * 0.0
    return mean_loss * n / num_items_in_batch


def _loss_dtype(logits: torch.Tensor) -> torch.Tensor:
    """Losses in fp32 at least: half-precision logits are upcast, fp64 ones kept."""
    return logits if logits.dtype == torch.float64 else logits.float()


PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def infer_problem_type(logits: torch.Tensor, labels: torch.Tensor) -> str:
    """HF's rule: regression for one output, multi-label for float labels [B, C], else single-label."""
    if logits.shape[-1] == 1:
        return "regression"
    if labels.is_floating_point() and tuple(labels.shape) == tuple(logits.shape):
        return "multi_label_classification"
    return "single_label_classification"


def classification_loss(logits: torch.Tensor, labels: torch.Tensor, problem_type: str | None) -> torch.Tensor:
    """The loss of logits [B, C] as Hugging Face's heads define it: ``problem_type`` (or, when None,
    regression for C = 1, multi-label for float labels [B, C], else single-label) decides MSE,
    BCE-with-logits or cross-entropy. Labels of the wrong size raise instead of broadcasting."""
    B, C = logits.shape
    if problem_type is None:
        problem_type = infer_problem_type(logits, labels)
    if problem_type == "regression":
        if labels.numel() != B * C:
            raise ValueError(f"regression labels must have B·num_labels = {B * C} values ([B] or [B, {C}]), got "
                             f"{tuple(labels.shape)}")
        return F.mse_loss(_loss_dtype(logits), labels.to(_loss_dtype(logits).dtype).reshape(B, C))
    if problem_type == "single_label_classification":
        if labels.numel() != B or labels.is_floating_point() and not bool((labels == labels.round()).all()):
            raise ValueError(f"single-label labels must be [B] = [{B}] class indices, got {tuple(labels.shape)} "
                             f"{labels.dtype}")
        targets = labels.reshape(B).long()
        bad = (targets != -100) & ((targets < 0) | (targets >= C))
        if targets.device.type != "meta" and bool(bad.any()):  # (had been an IndexError from the loss)
            raise ValueError(f"single-label labels must be class indices in [0, num_labels={C}) or -100 (not "
                             f"scored), got {int(targets[bad][0])}")
        return F.cross_entropy(_loss_dtype(logits), targets)
    if problem_type == "multi_label_classification":
        if tuple(labels.shape) != (B, C):
            raise ValueError(f"multi-label labels must be [B, num_labels] = [{B}, {C}], got {tuple(labels.shape)}")
        return F.binary_cross_entropy_with_logits(_loss_dtype(logits), labels.to(_loss_dtype(logits).dtype))
    raise ValueError(f"config.problem_type must be None or one of {PROBLEM_TYPES}, got {problem_type!r}")
