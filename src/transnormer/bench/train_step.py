"""Training-step throughput and peak memory of a preset, each measurement in a fresh process.

A fresh process per configuration makes the peak RSS (CPU) or peak allocated memory (GPU) that
configuration's own. The step is a full optimizer step (forward, backward, AdamW) on random
tokens with a fixed number of tokens per step, so lengths are compared at equal work per step.
"""

from __future__ import annotations

import json
import time

from .._files import atomic_write_text


def require_causal(preset: str, **overrides) -> None:
    """Raise unless the preset is causal: trained as an LM, a bidirectional model sees the tokens it predicts."""
    from ..presets import get_config

    if not get_config(preset, **overrides).causal:
        raise ValueError(f"preset {preset!r} is bidirectional (causal=False): bench train/infer measure causal "
                         "LM steps; use an -lm preset")


def build_bench_model(preset: str, seq_len: int, vocab_size: int | None, overrides: dict):
    """A causal LM for benchmarking: one of our presets, or a peer (``peer:NAME``, see bench/peers.py)."""
    if preset.startswith("peer:"):
        from .peers import build_peer_model

        model = build_peer_model(preset[5:], seq_len=seq_len, vocab_size=vocab_size, **overrides)
        if not model.config.peer_args.get("causal", True):  # (had been timed as a causal LM)
            raise ValueError(f"{preset} as asked ({overrides}) is bidirectional: bench train/infer measure causal "
                             "LM steps; match an -lm preset")
        return model
    from ..presets import build_model

    kw = {"dropout": 0.0, "max_position_embeddings": max(seq_len, 512), **overrides}
    if vocab_size:
        kw["vocab_size"] = vocab_size
    require_causal(preset, **kw)
    return build_model(preset, task="clm", **kw)


def lm_loss(model, ids):
    """Next-token loss of our models (HF output) and of peers (raw logits)."""
    import torch.nn.functional as F

    out = model(input_ids=ids, labels=ids, return_logits=False, use_cache=False, return_dict=True) \
        if not getattr(model, "is_peer", False) else None
    if out is not None:
        return out.loss
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


_MAX_WARMUP = 6  # warm-up steps at most
_STEADY_FAULT_MB = 32  # a step that faults in less fresh memory than this counts as steady


def _faulted_mb() -> float:
    """A reading that grows by the fresh memory a step faults in, MB: the resident set on Linux
    (with :func:`~transnormer.runtime.tune_allocator` the heap never shrinks, so its growth is the
    fresh pages); elsewhere minor faults times the page size, which undercounts where one fault
    maps a transparent huge page."""
    import resource

    from ..runtime import rss_mb

    rss = rss_mb()
    return rss if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_minflt * resource.getpagesize() / 2**20


def _warm_up(step, faulted_mb, *, min_steps: int = 2, max_steps: int = _MAX_WARMUP,
             steady_mb: float = _STEADY_FAULT_MB):
    """Run ``step`` until the process is in its steady state; returns (its last result, steps run).

    The optimizer state appears in the first step; glibc's heap then grows for a few more (t2-lm,
    bf16, T = 512: 3,200, 423, 41, 69, then 0 MB of fresh pages faulted in per step), and a step
    that faults pages in runs 3-7% slower. So ``min_steps``, then more until one step faults in
    under ``steady_mb`` (``faulted_mb`` None: no such reading, ``min_steps`` only), ``max_steps``
    at most.
    """
    if not 1 <= min_steps <= max_steps:
        raise ValueError(f"warm-up needs 1 <= min_steps <= max_steps, got {min_steps} and {max_steps}")
    for n in range(1, max_steps + 1):
        before = None if faulted_mb is None else faulted_mb()
        result = step()
        if n >= min_steps and (before is None or faulted_mb() - before < steady_mb):
            break
    return result, n


def _cap_address_space(max_mem_gb: float) -> None:
    """Make an allocation past ``max_mem_gb`` of address space fail with an error in this process
    (PyTorch: "can't allocate memory") instead of waking the OOM killer, which may pick another
    process on a shared machine. The cap is on virtual memory, which runs ~0.5 GB above the
    resident set for a PyTorch process (libraries, thread stacks)."""
    import resource

    cap = int(max_mem_gb * 2**30)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))


def _measure(preset: str, seq_len: int, dtype: str, tokens_per_step: int, vocab_size: int | None, steps: int,
             threads: int | None, overrides: dict, mode: str = "train", max_mem_gb: float | None = None) -> dict:

    import torch

    from ..runtime import threads_from_env
    from .timing import peak_rss_mb

    if max_mem_gb is not None and not torch.cuda.is_available():
        import transformers  # noqa: F401  (libraries are mapped before the cap: it is for the model and its step)

        _cap_address_space(max_mem_gb)
    threads = threads or threads_from_env()  # `bench --threads` sets it for children
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    overrides = dict(overrides)
    checkpointing = overrides.pop("gradient_checkpointing", False)
    model = build_bench_model(preset, seq_len, vocab_size, overrides)
    if checkpointing:
        model.activation_checkpointing_enable()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(dev).train(mode == "train")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) if mode == "train" else None  # as train/loop.py
    batch = max(1, tokens_per_step // seq_len)
    vocab = vocab_size or model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len), device=dev)

    grads_finite = True  # of every warm-up step (untimed, so the check costs the timed steps nothing)

    def step(check_grads: bool = False):
        nonlocal grads_finite
        if mode == "train":
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=dtype == "bf16"):
                loss = lm_loss(model, ids)
            loss.backward()
            if check_grads:
                grads_finite &= all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()
                                    if p.grad is not None)
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16, enabled=dtype == "bf16"):
                loss = lm_loss(model, ids)
        if dev == "cuda":
            torch.cuda.synchronize()
        return float(loss.detach())

    loss, warmup = _warm_up(lambda: step(check_grads=True), _faulted_mb if dev == "cpu" else None)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    times.sort()
    t = times[len(times) // 2]
    peak = torch.cuda.max_memory_allocated() / 2**20 if dev == "cuda" else peak_rss_mb()
    params = sum(p.numel() for p in model.parameters())
    # A NaN gradient in a timed step shows in the weights AdamW then wrote
    params_finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    loss_finite = bool(torch.isfinite(torch.tensor(loss)))
    return {"preset": preset, "mode": mode, "seq_len": seq_len, "batch": batch, "dtype": dtype, "step_s": t,
            "tokens_per_s": batch * seq_len / t, "peak_mem_mb": peak, "loss": loss, "params": params,
            "loss_finite": loss_finite, "grads_finite": grads_finite, "params_finite": params_finite,
            "finite": loss_finite and grads_finite and params_finite, "warmup_steps": warmup,
            "threads": torch.get_num_threads()}


def check_bench_mode(mode) -> None:
    """``"train"`` (a training step) or ``"infer"`` (a no-grad forward), else a ValueError."""
    if mode not in ("train", "infer"):
        raise ValueError(f"mode must be 'train' or 'infer', got {mode!r}")


def train_step_throughput(preset: str, seq_len: int, *, dtype: str = "fp32", tokens_per_step: int = 8192,
                          vocab_size: int | None = 32768, steps: int = 3, threads: int | None = None,
                          overrides: dict | None = None, isolate: bool = True, mode: str = "train",
                          max_mem_gb: float | None = None) -> dict:
    """Median step time, tokens/s and peak memory of one configuration (see module docstring).

    ``mode="infer"`` times a no-grad forward instead of a training step. ``max_mem_gb`` (CPU, fresh
    process only) caps the measuring process's address space, so that a configuration too large
    for the machine fails with an out-of-memory error instead of being killed.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:  # (0 had been an IndexError)
        raise ValueError(f"steps must be an int >= 1 (timed steps after the warm-up), got {steps!r}")
    # (an unknown dtype or mode had been measured as fp32 / a forward under its own name)
    check_bench_mode(mode)
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be 'fp32' or 'bf16' (autocast), got {dtype!r}")
    for name, value in (("seq_len", seq_len), ("tokens_per_step", tokens_per_step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if max_mem_gb is not None:
        if isinstance(max_mem_gb, bool) or not isinstance(max_mem_gb, (int, float)) or not 0 < max_mem_gb < 2**20:
            raise ValueError(f"max_mem_gb must be a finite number of GB > 0 (below 2^20), got {max_mem_gb!r}")
        if not isolate:
            raise ValueError("max_mem_gb needs isolate=True: the cap would stay on the calling process")
    args = (preset, seq_len, dtype, tokens_per_step, vocab_size, steps, threads, overrides or {}, mode, max_mem_gb)
    if not isolate:
        return _measure(*args)
    from ..runtime import call_in_fresh_process

    return call_in_fresh_process(_measure, *args)


def _inplace_product_flop(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of addmm_ / baddbmm_ (self += a @ b), as the counter's formulas for mm / bmm."""
    from torch.utils.flop_counter import bmm_flop, mm_flop

    return (mm_flop if len(a_shape) == 2 else bmm_flop)(a_shape, b_shape)


def _inplace_products() -> dict:
    import torch

    return {torch.ops.aten.addmm_: _inplace_product_flop, torch.ops.aten.baddbmm_: _inplace_product_flop}


def counted_step_flops(preset: str, seq_len: int, *, vocab_size: int | None = 32768, batch: int = 1,
                       isolate: bool = True) -> float:
    """FLOPs of one training forward and backward (no optimizer) as PyTorch executes the math.

    Counted by ``torch.utils.flop_counter`` (its matmul-class ops, plus the in-place addmm_ and
    baddbmm_ our PyTorch forms accumulate with, which it does not know) with the fused kernels
    switched off and attention on SDPA's math path, so our models and a peer are counted the same
    way. This is the work each model's PyTorch forms *do*, not the FLOPs its math needs: a chunked
    or blocked form counts its full c x c products, SDPA its full T x T scores, and LRPE's PyTorch
    form its rotation of q and k as an [e, 2e] product. Our fused CPU kernels skip the causal zero
    halves and rotate without a product, so t2-lm's count at 4k is ~2% above what its CPU step
    runs (0.6% the halves, 1.4% the rotation). The ratio of two
    counts is the speed ratio the two would have at equal GFLOP/s. Runs in a fresh process unless
    ``isolate=False``: a child inherits its parent's peak RSS, so counting in the benchmark's own
    process would inflate every later memory reading.
    """
    if isolate:
        from ..runtime import call_in_fresh_process

        return call_in_fresh_process(counted_step_flops, preset, seq_len, vocab_size=vocab_size, batch=batch,
                                     isolate=False)
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from ..ops import _native

    torch.manual_seed(0)
    model = build_bench_model(preset, seq_len, vocab_size, {}).train()
    ids = torch.randint(0, vocab_size or model.config.vocab_size, (batch, seq_len))
    mode = _native.backend()
    _native.set_backend("torch")
    try:
        # SDPA's math path is composite, so its products reach the counter (the CPU flash kernel's do not)
        with FlopCounterMode(display=False, custom_mapping=_inplace_products()) as counter, sdpa_kernel(SDPBackend.MATH):
            lm_loss(model, ids).backward()
    finally:
        _native.set_backend(mode)
    return float(counter.get_total_flops())


# Backward products per forward product of the attention kernels, as they run (``recompute``):
# the softmax kernels (vanilla's attention, DiagAttention's blocks) follow FlashAttention-2, five
# products backward for two forward (it recomputes the scores; FA-2's paper counts the backward
# as 2.5x the forward for that reason). The causal linear-attention kernel recomputes the chunk
# states (its dQ pass) and the score tiles (its dK/dV pass): of the forward's two state products
# (Q S, Kᵀ V) the backward runs five, of its two score-tile products (Q Kᵀ, A V) six.
_SOFTMAX_BWD = 2.5
_NORM_STATES_BWD, _NORM_TILES_BWD = 2.5, 3.0


def model_flops_per_token(config, seq_len: int, *, recompute: bool = False) -> float:
    """Training FLOPs per token of the dense GEMMs and the mixers (forward + backward = 3x forward
    without ``recompute``).

    Dense: 2·(non-embedding params + LM head). Mixers per layer, by type (forward, per token):
    softmax causal ≈ 2·T·d (QKᵀ and AV on the causal half), norm ≈ 4·d·e + 2·c·d (states + intra-chunk),
    diag ≈ 2·w·d (causal half of a block). Used to print the ideal time ratio beside the measured one.
    With ``recompute`` the mixers' backward counts the products the fused kernels recompute
    (``_SOFTMAX_BWD``, ``_NORM_*_BWD``): the FLOPs the kernels execute, as FlashAttention-2's
    paper counts them. MFU is read without (the model's FLOPs, by its definition).
    """
    d, L = config.hidden_size, config.num_hidden_layers
    e = d // config.num_attention_heads
    # (a bidirectional config had been counted as causal: 37% under for vanilla at 16k)
    if not config.causal:  # (a mixer's own causal cannot differ: TransNormerConfig.check)
        raise ValueError("model_flops_per_token counts causal LMs only (the config is bidirectional)")
    # each layer type's own chunk and block (layer_options), as the layer builders read them
    chunk = config.options_for("norm").get("chunk_size", config.chunk_size)
    block = config.options_for("diag").get("block_size", config.block_size)
    if config.ffn_type not in ("glu", "ffn"):
        raise ValueError(f"model_flops_per_token has no FLOP model for ffn_type {config.ffn_type!r}")
    ffn_hidden = config.ffn_hidden_size or (int(8 * d / 3) if config.ffn_type == "glu" else 4 * d)
    per_layer_dense = 2 * (4 * d * d + (3 if config.ffn_type == "glu" else 2) * d * ffn_hidden)
    softmax_bwd, states_bwd, tiles_bwd = (_SOFTMAX_BWD, _NORM_STATES_BWD, _NORM_TILES_BWD) if recompute else (2, 2, 2)
    mixer = 0.0  # forward + backward
    for t in config.layer_types:
        if t == "softmax":
            mixer += (1 + softmax_bwd) * 2 * seq_len * d
        elif t == "norm":
            mixer += (1 + states_bwd) * 4 * d * e + (1 + tiles_bwd) * 2 * chunk * d
        elif t == "diag":
            mixer += (1 + softmax_bwd) * 2 * block * d
        else:  # FLASH, GAU, the linear baselines: their dense parts differ too (use counted_step_flops)
            raise ValueError(f"model_flops_per_token has no FLOP model for layer type {t!r}")
    head = 2 * d * config.vocab_size
    return 3 * (L * per_layer_dense + head) + mixer


def dump(results: list[dict], path) -> None:
    atomic_write_text(path, json.dumps(results, indent=1))
