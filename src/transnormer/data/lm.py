"""Causal language-modelling batches from a 1-D token stream (e.g. a token-cache memmap).

Batches are ``{"input_ids": LongTensor[B, T], "labels": LongTensor[B, T]}`` with Hugging Face semantics:
``labels`` equal ``input_ids`` (``-100`` where a position must not be scored) and the model shifts them, so a
window of ``T`` tokens trains ``T - 1`` next-token predictions.

Training (:class:`LMBatchIterator`): an infinite, deterministic sequence of batches that is a pure function
of ``(seed, step)``. Epoch ``e`` cuts the stream into windows ``tokens[o + i*T : o + (i+1)*T]`` with a
per-epoch offset ``o`` in ``[0, T)`` (so window boundaries move between epochs) and visits them in a
per-epoch random order; both come from ``numpy.random.default_rng([seed, e])``. Step ``k`` of the epoch
takes windows ``k*G .. (k+1)*G - 1`` of that order, ``G = batch_size * world_size``, and rank ``r`` gets the
``r``-th slice of ``batch_size`` of them: ranks never share a window and together cover the global batch.
An incomplete last global batch of an epoch is dropped. Because batch ``k`` depends only on
``(seed, k)``, resuming is just restoring ``step`` (:meth:`LMBatchIterator.state_dict`).

Evaluation (:func:`eval_batches`): sequential windows with a stride; positions already scored by the
previous window are labelled ``-100`` so every token is scored at most once.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["LMBatchIterator", "LMWindowDataset", "eval_batches", "count_targets"]


def _check_tokens(tokens) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.numpy()
    if not isinstance(tokens, np.ndarray):
        raise TypeError(f"tokens must be a 1-D numpy array (or memmap/tensor), got {type(tokens).__name__}")
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise TypeError(f"tokens must hold integers, got dtype {tokens.dtype}")
    return tokens


def _check_pos_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_shard(rank, world_size) -> tuple[int, int]:
    """(rank, world_size) checked: ints with 0 <= rank < world_size."""
    world_size = _check_pos_int("world_size", world_size)
    rank = _check_pos_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size={world_size}, got {rank}")
    return rank, world_size


def _gather(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    """``LongTensor[len(starts), seq_len]`` of ``tokens[s : s + seq_len]`` for each start."""
    index = starts[:, None] + np.arange(seq_len)[None, :]
    # Fancy indexing reads only these pages of a memmap; int64 because embeddings want LongTensor.
    return torch.from_numpy(np.asarray(tokens[index], dtype=np.int64))


class LMWindowDataset(torch.utils.data.Dataset):
    """Map-style dataset of windows ``tokens[i*stride : i*stride + seq_len]``.

    Args:
        tokens: 1-D integer array ``[N]``.
        seq_len: window length ``T``.
        stride: distance between window starts (default ``seq_len``: non-overlapping).

    Item ``i`` is ``{"input_ids": LongTensor[T], "labels": LongTensor[T]}``; a tail shorter than ``T`` is
    not used.
    """

    def __init__(self, tokens, seq_len: int, stride: int | None = None) -> None:
        self.tokens = _check_tokens(tokens)
        self.seq_len = _check_pos_int("seq_len", seq_len, 2)
        self.stride = self.seq_len if stride is None else _check_pos_int("stride", stride)
        if len(self.tokens) < self.seq_len:
            raise ValueError(f"tokens has {len(self.tokens)} ids, fewer than seq_len={self.seq_len}")

    def __len__(self) -> int:
        return (len(self.tokens) - self.seq_len) // self.stride + 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"window {i} out of range for {n} windows")
        i %= n
        ids = _gather(self.tokens, np.array([i * self.stride]), self.seq_len)[0]
        return {"input_ids": ids, "labels": ids.clone()}


class StepBatches:
    """Iteration and resume shared by the step-indexed batch iterators: ``batch_at(step)`` is a pure
    function of the step, so iterating is stepping and resuming is restoring ``step``."""

    def __init__(self, tokens, seq_len: int, batch_size: int, seed: int, rank: int, world_size: int,
                 step: int) -> None:
        self.tokens = _check_tokens(tokens)
        self.seq_len = _check_pos_int("seq_len", seq_len, 2)
        self.batch_size = _check_pos_int("batch_size", batch_size)
        self.seed = _check_pos_int("seed", seed, 0)
        self.rank, self.world_size = _check_shard(rank, world_size)
        self.step = _check_pos_int("step", step, 0)
        self.global_batch_size = self.batch_size * self.world_size

    def batch_at(self, step: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    @functools.cached_property
    def tokens_fingerprint(self) -> str:
        """A hash of 4,096 tokens spread over the stream (and its length). Kept in the state beside
        :attr:`tokens_digest` so that checkpoints saved before the digest are still checked by it."""
        import hashlib

        n = len(self.tokens)
        picks = np.linspace(0, n - 1, num=min(n, 4096)).astype(np.int64) if n else np.zeros(0, np.int64)
        sample = np.asarray(self.tokens[picks], dtype=np.int64)
        return hashlib.sha256(sample.tobytes() + n.to_bytes(8, "little")).hexdigest()[:16]

    @functools.cached_property
    def tokens_digest(self) -> str:
        """sha256 of the whole stream (as little-endian uint32, whatever the array's dtype): on resume, a
        corpus edited under the same token count (one token of a --data folder) no longer matches, which
        a sample of the stream would miss. Computed once per run, when the training loop first reads the
        data state (before its first step, outside the timed steps; ~1 GB/s: a few seconds for a
        billion tokens, read a chunk at a time from a memory-mapped cache)."""
        import hashlib

        h, step = hashlib.sha256(), 1 << 24
        for lo in range(0, len(self.tokens), step):
            h.update(np.ascontiguousarray(self.tokens[lo:lo + step], dtype="<u4").tobytes())
        return h.hexdigest()[:32]

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state["step"]``.

        The world size may change on resume as long as ``batch_size * world_size`` stays the same.

        Raises:
            ValueError: the state was saved with other settings (a different seed, sequence length,
                global batch size or data): resuming would silently change the data order.
        """
        if not isinstance(state, dict) or "step" not in state:
            raise TypeError(f"state must be a dict from {type(self).__name__}.state_dict()")
        state = {"packing": "contiguous", **state}  # states saved before the field were all contiguous windows
        mine = self.state_dict()
        diffs = [
            f"{k}: saved {state[k]!r}, now {mine[k]!r}"
            for k in mine
            if k != "step" and k in state and state[k] != mine[k]
        ]
        if diffs:
            raise ValueError("state does not match this data iterator (" + "; ".join(diffs) + ")")
        self.step = _check_pos_int("state['step']", state["step"], 0)


class LMBatchIterator(StepBatches):
    """Deterministic, resumable, rank-sharded training batches (see the module docstring).

    Args:
        tokens: 1-D integer array ``[N]`` (a token-cache memmap is not copied).
        seq_len: tokens per sequence ``T``.
        batch_size: sequences per batch on this rank ``B``.
        seed: data-order seed (>= 0).
        rank, world_size: this process's shard; all ranks must use the same other arguments.
        step: global step to start at (e.g. after resuming from a checkpoint).
        random_offset: shift window boundaries by a random offset per epoch.
        attention_mask: also return an all-ones ``attention_mask``.

    Iterating yields ``{"input_ids": LongTensor[B, T], "labels": LongTensor[B, T]}`` forever; ``step``
    counts the batches yielded so far (identical on all ranks).
    """

    def __init__(
        self,
        tokens,
        seq_len: int,
        batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        step: int = 0,
        random_offset: bool = True,
        attention_mask: bool = False,
    ) -> None:
        super().__init__(tokens, seq_len, batch_size, seed, rank, world_size, step)
        self.random_offset = bool(random_offset)
        self.attention_mask = bool(attention_mask)
        n = len(self.tokens)
        worst_offset = self.seq_len - 1 if self.random_offset else 0
        fewest_windows = max(0, n - worst_offset) // self.seq_len
        if fewest_windows < self.global_batch_size:
            raise ValueError(
                f"tokens has {n} ids: at most {fewest_windows} windows of seq_len={self.seq_len} per epoch, "
                f"fewer than batch_size*world_size={self.global_batch_size}; use less data per step or more data"
            )
        self._epoch_starts = [0]  # _epoch_starts[e] = first global step of epoch e (grown lazily)
        self._cached_epoch: tuple[int, int, np.ndarray] | None = None

    # --------------------------------------------------------------------------------------- schedule
    def _epoch_plan(self, epoch: int) -> tuple[int, np.ndarray]:
        """(offset, window order) of ``epoch``."""
        if self._cached_epoch is not None and self._cached_epoch[0] == epoch:
            return self._cached_epoch[1], self._cached_epoch[2]
        rng = np.random.default_rng([self.seed, epoch])
        offset = int(rng.integers(self.seq_len)) if self.random_offset else 0
        n_windows = (len(self.tokens) - offset) // self.seq_len
        order = rng.permutation(n_windows)
        self._cached_epoch = (epoch, offset, order)
        return offset, order

    def steps_in_epoch(self, epoch: int) -> int:
        """Number of global batches in ``epoch`` (varies slightly with the epoch's offset)."""
        _, order = self._epoch_plan(_check_pos_int("epoch", epoch, 0))
        return len(order) // self.global_batch_size

    def _locate(self, step: int) -> tuple[int, int]:
        """(epoch, step within epoch) of a global step."""
        while self._epoch_starts[-1] <= step:
            e = len(self._epoch_starts) - 1
            rng = np.random.default_rng([self.seed, e])
            offset = int(rng.integers(self.seq_len)) if self.random_offset else 0
            steps = ((len(self.tokens) - offset) // self.seq_len) // self.global_batch_size
            self._epoch_starts.append(self._epoch_starts[-1] + steps)
        epoch = int(np.searchsorted(self._epoch_starts, step, side="right")) - 1
        return epoch, step - self._epoch_starts[epoch]

    @property
    def epoch(self) -> int:
        """Epoch of the next batch."""
        return self._locate(self.step)[0]

    def batch_at(self, step: int) -> dict[str, torch.Tensor]:
        """This rank's batch for global ``step`` (does not move the iterator)."""
        epoch, k = self._locate(_check_pos_int("step", step, 0))
        offset, order = self._epoch_plan(epoch)
        lo = k * self.global_batch_size + self.rank * self.batch_size
        windows = order[lo : lo + self.batch_size]
        ids = _gather(self.tokens, offset + windows * self.seq_len, self.seq_len)
        batch = {"input_ids": ids, "labels": ids.clone()}
        if self.attention_mask:
            batch["attention_mask"] = torch.ones_like(ids)
        return batch

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, int | bool]:
        """Data position plus the settings that must match on resume."""
        return {
            "step": self.step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "num_tokens": len(self.tokens),
            "tokens": self.tokens_fingerprint,
            "tokens_digest": self.tokens_digest,
            "random_offset": self.random_offset,
            "packing": "contiguous",  # (BlockBatchIterator: "complete"): an MLM run cannot resume on the other
        }


def eval_batches(
    tokens,
    seq_len: int,
    batch_size: int,
    *,
    stride: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    with_index: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """Sequential evaluation windows over the whole stream.

    Windows of ``T = min(seq_len, N)`` tokens start every ``stride`` tokens (default ``seq_len``), plus a
    last window ending at the stream's end. In each window, labels of tokens that an earlier window already
    scored are ``-100``. With ``stride < seq_len`` every token except the very first is scored exactly once
    and with at least ``seq_len - stride`` tokens of context; with ``stride == seq_len`` the first token
    of each window is not scored (it has no context inside the window), as in HF ``run_clm``.

    Args:
        tokens: 1-D integer array ``[N]``, ``N >= 2``.
        rank, world_size: window ``i`` goes to rank ``i % world_size``.
        with_index: also yield ``"window": LongTensor[b]``, each window's index ``i`` in the split.

    Yields:
        ``{"input_ids": LongTensor[b, T], "labels": LongTensor[b, T]}`` with ``b <= batch_size``.
    """
    tokens = _check_tokens(tokens)
    seq_len = _check_pos_int("seq_len", seq_len, 2)
    batch_size = _check_pos_int("batch_size", batch_size)
    rank, world_size = _check_shard(rank, world_size)
    n = len(tokens)
    if n < 2:
        raise ValueError(f"tokens has {n} ids; evaluation needs at least 2")
    t = min(seq_len, n)
    if stride is not None and _check_pos_int("stride", stride) > seq_len:
        raise ValueError(f"stride must be <= seq_len={seq_len}, got {stride}")
    stride = t if stride is None else min(stride, t)  # a split shorter than seq_len: one window
    starts = list(range(0, n - t + 1, stride))
    if starts[-1] + t < n:
        starts.append(n - t)
    # Number of leading positions of each window whose tokens an earlier window already covered.
    scored_before = [0] + [max(0, starts[i - 1] + t - starts[i]) for i in range(1, len(starts))]
    mine = list(range(rank, len(starts), world_size))
    for lo in range(0, len(mine), batch_size):
        idx = mine[lo : lo + batch_size]
        ids = _gather(tokens, np.array([starts[i] for i in idx]), t)
        labels = ids.clone()
        for row, i in enumerate(idx):
            labels[row, : scored_before[i]] = -100
        batch = {"input_ids": ids, "labels": labels}
        if with_index:
            batch["window"] = torch.tensor(idx, dtype=torch.long)
        yield batch


def count_targets(labels: torch.Tensor) -> int:
    """Number of scored next-token targets in HF-style ``labels [B, T]`` (position 0 is never a target)."""
    if not isinstance(labels, torch.Tensor) or labels.ndim != 2:
        raise TypeError("labels must be a 2-D LongTensor [B, T]")
    return int((labels[:, 1:] != -100).sum())
