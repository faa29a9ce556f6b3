"""Evaluation metrics (accuracy, macro-F1, Matthews correlation; Pearson and Spearman for regression) and a
classifier evaluated over a split."""

from __future__ import annotations

import math

import numpy as np
import torch

from .distributed import DistInfo, all_reduce_sum, forwards_to_match


def classification_metrics(pred: torch.Tensor, gold: torch.Tensor, num_classes: int | None = None) -> dict:
    """Accuracy, macro F1 and Matthews correlation (multi-class R_K) of integer predictions [N].

    Macro F1 averages over the classes in the gold labels or the predictions (scikit-learn's
    ``f1_score(average="macro")``: a class predicted but absent scores 0). ``num_classes`` (the
    model's label count): a binary task reports ``f1_positive`` (GLUE's F1 of class 1) even when an
    evaluation holds no class 1; without it, the classes are those seen."""
    pred, gold = pred.long().flatten(), gold.long().flatten()
    n = int(gold.numel())
    if n == 0:
        return {"accuracy": float("nan"), "f1": float("nan"), "mcc": float("nan"), "n": 0}
    k = max(int(max(pred.max(), gold.max())) + 1, num_classes or 0)
    cm = torch.zeros(k, k, dtype=torch.float64)
    cm.index_put_((gold, pred), torch.ones(n, dtype=torch.float64), accumulate=True)
    tp = cm.diag()
    f1s = []
    for c in range(k):
        denom = 2 * tp[c] + (cm[c].sum() - tp[c]) + (cm[:, c].sum() - tp[c])
        if denom > 0:  # classes in the gold labels or the predictions
            f1s.append(float(2 * tp[c] / denom))
    # Gorodkin's multi-class MCC; equals the binary MCC for k = 2
    t, p, c, s = cm.sum(1), cm.sum(0), float(tp.sum()), float(n)
    cov_xy = c * s - float((t * p).sum())
    cov_xx = s * s - float((p * p).sum())
    cov_yy = s * s - float((t * t).sum())
    mcc = cov_xy / math.sqrt(cov_xx * cov_yy) if cov_xx > 0 and cov_yy > 0 else 0.0
    out = {"accuracy": c / n, "f1": sum(f1s) / max(len(f1s), 1), "mcc": mcc, "n": n}
    if k == 2:  # GLUE reports the F1 of the positive class for binary tasks
        denom = 2 * tp[1] + (cm[1].sum() - tp[1]) + (cm[:, 1].sum() - tp[1])
        out["f1_positive"] = float(2 * tp[1] / denom) if denom > 0 else 0.0
    return out


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks of x [N] (float64), ties given their mean rank (as scipy's rankdata)."""
    order = torch.argsort(x, stable=True)
    xs = x[order]
    ranks = torch.empty_like(x, dtype=torch.float64)
    ranks[order] = torch.arange(len(x), dtype=torch.float64)
    # each run of equal values gets the mean of its positions
    starts = torch.cat([torch.tensor([True]), xs[1:] != xs[:-1]])
    run = torch.cumsum(starts.long(), 0) - 1
    mean = torch.zeros(int(run[-1]) + 1, dtype=torch.float64).index_add_(0, run, ranks[order])
    mean /= torch.bincount(run).double()
    ranks[order] = mean[run]
    return ranks


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    denom = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    return float((a * b).sum()) / denom if denom > 0 else float("nan")  # a constant has no correlation


def regression_metrics(pred: torch.Tensor, gold: torch.Tensor) -> dict:
    """Pearson and Spearman correlation (GLUE's STS-B scores) and the mean squared error of real
    predictions [N] against their targets."""
    pred, gold = pred.double().flatten(), gold.double().flatten()
    if pred.numel() != gold.numel():
        raise ValueError(f"pred and gold must hold as many values, got {pred.numel()} and {gold.numel()}")
    n = int(gold.numel())
    if n == 0:
        return {"pearson": float("nan"), "spearman": float("nan"), "mse": float("nan"), "n": 0}
    mse = float(((pred - gold) ** 2).mean())
    if not (bool(torch.isfinite(pred).all()) and bool(torch.isfinite(gold).all())):
        # (NaN predictions had been ranked in a fixed order: a broken model got a finite Spearman)
        return {"pearson": float("nan"), "spearman": float("nan"), "mse": mse, "n": n}
    return {"pearson": _pearson(pred, gold), "spearman": _pearson(_ranks(pred), _ranks(gold)), "mse": mse, "n": n}


@torch.no_grad()
def evaluate_classifier(model, ds, collate, info: DistInfo, batch_size: int, max_batches: int | None, autocast, *,
                        majority_class: int | None = None) -> dict:
    """Loss / accuracy / F1 / MCC of a sequence classifier ``model`` on ``ds`` (rank-sharded), the
    batches made by ``collate`` (every key but ``labels`` goes to the model: LRA's pair tasks give two
    sequences); with ``majority_class``, that class's accuracy on the same items too.

    With ``max_batches`` covering less than the split, the items are a fixed random subset (the
    same at every call), not the first ones: classification files are often sorted by label (IMDB's
    negative reviews come first), so a prefix would score one class (the GLUE-style ``--task cls``
    path had scored its split's first rows). The metrics count the model's ``config.num_labels``
    classes where it has one (:func:`classification_metrics`). A regression model (one output,
    ``problem_type="regression"``: STS-B) gets its MSE as the loss and :func:`regression_metrics`."""
    if max_batches is not None and (isinstance(max_batches, bool) or not isinstance(max_batches, int)
                                    or max_batches < 1):
        raise ValueError(f"max_batches must be an int >= 1 or None (the whole split), got {max_batches!r}")
    num_classes = getattr(getattr(model, "config", None), "num_labels", None)
    regression = num_classes == 1 or getattr(getattr(model, "config", None), "problem_type", None) == "regression"
    was_training = model.training
    model.eval()
    preds, golds, loss_sum = [], [], 0.0
    order = np.arange(len(ds))
    if max_batches is not None and max_batches * batch_size * info.world_size < len(ds):
        order = np.random.default_rng(0).permutation(len(ds))
    idx = order[info.rank::info.world_size].tolist()
    starts = list(range(0, len(idx), batch_size))[:max_batches]
    extra = forwards_to_match(model, len(starts), info)
    if extra:  # an FSDP rank in step with the others (results unused): its first batch, or the split's
        filler = {k: v.to(info.device) for k, v in collate([ds[i] for i in (idx or order.tolist())[:1]]).items()
                  if k != "labels"}
    for start in starts + [None] * extra:
        if start is None:
            with autocast():
                model(**filler, return_dict=True)
            continue
        batch = collate([ds[i] for i in idx[start:start + batch_size]])
        batch = {k: v.to(info.device) for k, v in batch.items()}
        labels = batch.pop("labels")
        with autocast():
            logits = model(**batch, return_dict=True).logits
        if regression:
            preds.append(logits.float()[:, 0].cpu())
            loss_sum += float(torch.nn.functional.mse_loss(preds[-1], labels.float().cpu(), reduction="sum"))
        else:
            preds.append(logits.argmax(-1).cpu())
            loss_sum += float(torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum"))
        golds.append(labels.cpu())
    if was_training:
        model.train()
    empty = torch.zeros(0, dtype=torch.float32 if regression else torch.long)  # (a rank without examples)
    p = torch.cat(preds) if preds else empty
    y = torch.cat(golds) if golds else empty
    if info.enabled:
        import torch.distributed as dist

        gathered = [None] * info.world_size
        dist.all_gather_object(gathered, (p, y))
        p = torch.cat([g[0] for g in gathered])
        y = torch.cat([g[1] for g in gathered])
    (loss_sum,) = all_reduce_sum([loss_sum], info)
    out = {"loss": loss_sum / len(y) if len(y) else float("nan"),  # nothing scored: NaN
           **(regression_metrics(p, y) if regression else classification_metrics(p, y, num_classes=num_classes))}
    if majority_class is not None:
        out["majority_accuracy"] = float((y == majority_class).float().mean()) if len(y) else float("nan")
    return out
