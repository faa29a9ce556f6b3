import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a−b| / max|b| (the spec's tolerance measure)."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
