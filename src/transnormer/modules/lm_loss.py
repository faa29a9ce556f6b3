"""Language-model head and cross-entropy in one pass over row chunks (no [N, V] logits kept).

With a 32k–268k vocabulary the head dominates a CPU training step: ``F.cross_entropy(h @ Wᵀ)``
materialises the [N, V] fp32 logits, a log-softmax copy, a zero-filled gradient of the same size
and its log-softmax backward — four passes over gigabytes. Here each chunk of rows computes its
logits, its loss terms and, right away, its gradient ``softmax − onehot`` (in place), from which
``dh`` and ``dW`` follow; the gradients are kept for the backward, which only scales them by the
incoming gradient. Same three GEMMs as the unfused head, one chunk of logits in memory.
"""

from __future__ import annotations

import torch

from ..ops import _native, dense
from ..ops._dtypes import autocast_enabled, autocast_off


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if autocast_enabled(dev) else x.dtype


def _default_chunk(vocab: int, half_block: bool = False, transposed_copy: bool = False) -> int:
    # Rows whose logits block fills 256 MB: 2048 rows of fp32 logits at a 32k vocabulary, 4096 of
    # half-precision ones (the fused half path keeps no fp32 block); large enough for efficient
    # GEMMs, a fraction of the unfused footprint. (bf16, 4k x 512 -> 32k, forward and backward:
    # 293-299 ms in chunks of 2048 rows, 271-275 ms in one of 4096.) Half that where the block
    # also has a transposed copy (the fp32 oneDNN path): its products ran as fast on 1024 rows.
    return max(64, 2**(27 if half_block else 26) // (2 if transposed_copy else 1) // max(vocab, 1))


_SCRATCH: dict = {}


def _scratch(slot: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [rows, cols] buffer kept across calls (CPU only). A fresh [n, V] block every step is
    page-faulted in again (the allocator has split the previous step's block for other tensors
    meanwhile): measured in a t2-lm step, 290 ms for a GEMM that takes 55 ms into a warm buffer."""
    numel = rows * cols
    if device.type != "cpu":  # the CUDA caching allocator already reuses blocks
        return torch.empty(rows, cols, dtype=dtype, device=device)
    key = (slot, dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        # a normal tensor even when first asked for under inference_mode: an inference tensor
        # could not be written in place by the training steps that reuse it
        with torch.inference_mode(False):
            buf = _SCRATCH[key] = torch.empty(numel, dtype=dtype)
    return buf[:numel].view(rows, cols)


def _torch_rows(x, wc, lab, ok, logits, low, total, need_grad):
    """The PyTorch form of one chunk: adds its loss terms to ``total``; returns the gradient block
    ``ok * (softmax - onehot)`` in the product dtype (in ``low``, else in ``logits``) or None."""
    if low is None:
        torch.mm(x, wc.T, out=logits)
    else:  # products in the autocast dtype, softmax in fp32
        logits.copy_(torch.mm(x, wc.T, out=low))
    target = logits.gather(1, lab[:, None]).squeeze(1)
    # log-sum-exp and softmax in place: torch.logsumexp would allocate a second [n, V] block,
    # which costs more than the arithmetic.
    m = logits.amax(dim=-1, keepdim=True)
    z = logits.sub_(m).exp_().sum(dim=-1, keepdim=True)  # logits now hold exp(l - m)
    # (m − target) + log z, not lse − target: an fp32 lse of logits ~1e4 is ~1e-3 off
    loss = (m.squeeze(1) - target) + z.log().squeeze(1)
    total += torch.where(ok, loss, 0.0).sum()
    if not need_grad:
        return None
    grad = logits.div_(z)  # softmax
    grad[torch.arange(grad.shape[0], device=grad.device), lab] -= 1.0
    grad.mul_(ok[:, None])  # ignored rows get no gradient
    return grad if low is None else low.copy_(grad)


def _onednn_products(h: torch.Tensor, weight: torch.Tensor, cdt: torch.dtype) -> bool:
    """Whether the head's products (in cdt, weight cast to it) run on oneDNN (ops/dense.py)."""
    return h.numel() > 0 and weight.numel() > 0 and weight.device == h.device and dense.onednn_for(cdt, h.device)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, ignore_index: int, chunk: int, need_h: bool, need_w: bool, cdt: torch.dtype):
        with autocast_off(h.device.type):
            V, d = weight.shape
            hc = h.to(cdt)
            wc = weight if weight.dtype == cdt else _scratch(2, V, d, cdt, h.device).copy_(weight)
            sdt = torch.promote_types(cdt, torch.float32)  # softmax dtype: fp32, or fp64 for fp64
            valid = labels != ignore_index
            # ignored rows index class 0 (their terms are masked out): ignore_index may lie anywhere
            labels = torch.where(valid, labels, 0)
            n_valid = valid.sum()
            total = torch.zeros((), dtype=sdt, device=h.device)
            need_grad = need_h or need_w  # the gradient block is made for either; each product only if asked
            dh = torch.empty_like(h) if need_h else None
            rows_max = min(chunk, h.shape[0])
            # Fused rows (ops/_native_xent.cpp): the logits block, in the product dtype, becomes the
            # gradient in place in one pass; otherwise the PyTorch form below (and for fp64).
            fused = _native.rows_usable(cdt, h.device)
            # fp32 products on oneDNN where MKL's are slow (ops/dense.py): each into a fresh block
            # (no out= there), dW from a transposed copy of the gradient block (an inner product
            # sums over its operands' rows: 17 ms per 2048 x 32k block against 145 for the product)
            onednn = fused and _onednn_products(h, weight, cdt)
            # dW is returned to autograd (which may keep it as .grad): a fresh tensor, written by the
            # first chunk's product instead of zero-filled first.
            dw = torch.empty(V, d, dtype=torch.promote_types(weight.dtype, sdt), device=h.device) \
                if need_w and not onednn else None
            wt = dense.dense_rows(wc.t()) if need_h and onednn else None  # [d, V]: dh = g (Wᵀ)ᵀ
            buf = None if fused and (cdt != sdt or onednn) else _scratch(0, rows_max, V, sdt, h.device)  # fp32 logits
            low = None if cdt == sdt else _scratch(1, rows_max, V, cdt, h.device)
            transposed_dw = fused and dw is not None and cdt == torch.bfloat16 and dw.dtype == torch.float32
            dw_low = None if dw is None or dw.dtype == cdt or transposed_dw else _scratch(3, V, d, cdt, h.device)
            for s in range(0, h.shape[0], chunk):
                x, lab, ok = hc[s:s + chunk], labels[s:s + chunk], valid[s:s + chunk]
                n = x.shape[0]
                if fused:
                    g = dense.mm_t(x, wc) if onednn else torch.mm(x, wc.T, out=buf[:n] if low is None else low[:n])
                    _, loss = _native.xent_rows(g, lab, ok, write_grad=need_grad)
                    total += torch.where(ok, loss, 0.0).sum()
                else:
                    g = _torch_rows(x, wc, lab, ok, buf[:n], None if low is None else low[:n], total, need_grad)
                if onednn:
                    if need_h:
                        dh[s:s + chunk] = dense.mm_t(g, wt)
                    if need_w:
                        gt, xt = dense.dense_rows(g.t()), dense.dense_rows(x.t())  # [V, n], [d, n]
                        dw = dense.mm_t(gt, xt) if dw is None else dense.mm_t_add(gt, xt, dw)
                    continue
                if need_h:
                    if dh.dtype == cdt:
                        torch.mm(g, wc, out=dh[s:s + chunk])
                    else:
                        dh[s:s + chunk] = g @ wc
                if need_w:
                    if transposed_dw:  # oneDNN runs xᵀ g at about twice the rate of gᵀ x in bf16
                        prod = torch.mm(dense.dense_rows(x.t()), g, out=_scratch(3, d, V, cdt, h.device))
                        _native.transpose_acc(prod, dw, accumulate=s > 0)
                    elif dw_low is None and s == 0:
                        torch.mm(g.T, x, out=dw)
                    elif dw_low is None:
                        dw.addmm_(g.T, x)
                    else:  # half-precision product, fp32 sum over chunks
                        torch.mm(g.T, x, out=dw_low)
                        if s == 0:
                            dw.copy_(dw_low)
                        else:
                            dw.add_(dw_low)
            if dw is not None and h.shape[0] == 0:
                dw.zero_()
        ctx.grads = (dh, dw)  # consumed (scaled in place) by the one backward
        ctx.save_for_backward(n_valid)
        ctx.weight_dtype = weight.dtype
        return total / n_valid  # all rows ignored: 0/0 = nan, as F.cross_entropy

    @staticmethod
    def backward(ctx, grad_loss):
        if torch.is_grad_enabled():  # create_graph=True: the gradients were computed in the forward, with
            # no graph, so a second derivative through them would silently read 0 (a gradient penalty)
            raise RuntimeError("linear_cross_entropy has no second derivative (create_graph=True); use "
                               "F.cross_entropy on the logits for a loss that must be differentiated twice")
        (n_valid,) = ctx.saved_tensors
        dh, dw = ctx.grads
        if dh is None and dw is None:
            raise RuntimeError("linear_cross_entropy: no gradients were computed (gradients disabled in the "
                               "forward), or backward ran twice through it (its gradients are used up)")
        ctx.grads = (None, None)
        # every row ignored (or none): the gradients are exact zeros, and stay zeros as
        # F.cross_entropy's do (its loss is nan, 0/0, but no row has a gradient to scale)
        scale = grad_loss / n_valid.clamp_min(1)
        dh = None if dh is None else dh.mul_(scale.to(dh.dtype))
        dw = None if dw is None else dw.mul_(scale).to(ctx.weight_dtype)
        return dh, dw, None, None, None, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                         chunk_size: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of ``h @ weight.T`` against ``labels`` without keeping the logits.

    Args:
        h: [N, d] hidden states.
        weight: [V, d] output embedding (a bias-free LM head, possibly tied).
        labels: [N] integer targets; ``ignore_index`` rows do not count.
        chunk_size: rows per chunk (one [chunk, V] logits block is alive at a time); default:
            as many rows as fill 256 MB (kept for reuse on CPU): 2**26 fp32 logits, or 2**27 in
            the fused bf16 path, which keeps no fp32 block; 2**25 where the fp32 products run on
            oneDNN, which also keeps a transposed copy of the block.

    Returns the scalar mean loss over non-ignored rows, equal to
    ``F.cross_entropy(h @ weight.T, labels, ignore_index=ignore_index)``. Under autocast the
    products run in the autocast dtype and the softmax in fp32, as autocast would do.
    """
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(f"h must be [N, d] and weight [V, d]; got {tuple(h.shape)} and {tuple(weight.shape)}")
    if labels.shape != h.shape[:1] or labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integer [N] = [{h.shape[0]}], got {labels.dtype} {tuple(labels.shape)}")
    V = weight.shape[0]
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= V))
    if bad.any():  # the fused rows index the logits block unchecked; F.cross_entropy raises here too
        raise ValueError(f"labels must lie in [0, {V}) or equal ignore_index={ignore_index}; "
                         f"got {labels[bad][0].item()}")
    cdt = _compute_dtype(h)
    if chunk_size is None:
        fused = _native.rows_usable(cdt, h.device)
        half_block = cdt in (torch.float16, torch.bfloat16) and fused
        chunk_size = _default_chunk(weight.shape[0], half_block, fused and _onednn_products(h, weight, cdt))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    grad = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(h, weight, labels, ignore_index, chunk_size, grad and h.requires_grad,
                                     grad and weight.requires_grad, cdt)
