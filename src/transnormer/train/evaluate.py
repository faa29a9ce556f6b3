"""Evaluation metrics: classification accuracy / macro-F1 / Matthews correlation."""

from __future__ import annotations

import math

import torch


def classification_metrics(pred: torch.Tensor, gold: torch.Tensor) -> dict:
    """Accuracy, macro F1 and Matthews correlation (multi-class R_K) of integer predictions [N]."""
    pred, gold = pred.long().flatten(), gold.long().flatten()
    n = int(gold.numel())
    if n == 0:
        return {"accuracy": float("nan"), "f1": float("nan"), "mcc": float("nan"), "n": 0}
    k = int(max(pred.max(), gold.max())) + 1
    cm = torch.zeros(k, k, dtype=torch.float64)
    cm.index_put_((gold, pred), torch.ones(n, dtype=torch.float64), accumulate=True)
    tp = cm.diag()
    f1s = []
    for c in range(k):
        denom = 2 * tp[c] + (cm[c].sum() - tp[c]) + (cm[:, c].sum() - tp[c])
        if cm[c].sum() > 0:  # classes present in the gold labels
            f1s.append(float(2 * tp[c] / denom) if denom > 0 else 0.0)
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
