"""Whole-sentence MLM samples: fairseq's ``--sample-break-mode complete`` (spec §8, RoBERTa recipe).

fairseq's masked-LM task reads a corpus one line (a "sentence") at a time and packs consecutive
lines into samples of at most ``tokens_per_sample - 1`` tokens without cutting a line, then puts
``<s>`` in front of each sample. Here the corpus is the token-cache stream (documents each followed
by EOS), so a sentence ends after an EOS or after any token whose text holds a newline (byte-level
BPE never merges across a newline with the next line's text: the pre-tokenizer splits there).

- :func:`complete_blocks` cuts a stream into ``[start, end)`` blocks of whole sentences. A single
  sentence longer than a block is cut into block-sized pieces (fairseq would emit it whole, longer
  than the model's positions, and the recipe skips such samples).
- :class:`BlockBatchIterator`: deterministic, resumable, rank-sharded training batches of blocks,
  a pure function of ``(seed, step)`` as :class:`~transnormer.data.lm.LMBatchIterator`: epoch ``e``
  visits every block once in the order ``default_rng([seed, e]).permutation``; step ``k`` takes
  blocks ``k*G .. (k+1)*G - 1`` of it (``G = batch_size * world_size``), rank ``r`` the ``r``-th slice.
- :func:`eval_block_batches`: every block of a split once, in order.

Batches are ``{"input_ids": LongTensor[B, T], "attention_mask": LongTensor[B, T]}``: ``<s>`` and the
block, right-padded with ``pad_id`` to ``T = seq_len``; masking is the caller's
(:func:`~transnormer.data.mlm.mask_tokens` never selects ``<s>`` or padding).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from .lm import StepBatches, _check_pos_int, _check_shard, _check_tokens

__all__ = ["line_end_ids", "complete_blocks", "BlockBatchIterator", "eval_block_batches"]


def line_end_ids(tokenizer) -> np.ndarray:
    """``bool[vocab_size]``: which ids end a sentence (EOS, and tokens whose text holds a newline)."""
    ends = np.zeros(tokenizer.vocab_size, dtype=bool)
    for i in range(tokenizer.vocab_size):
        if "\n" in tokenizer.decode([i], skip_special_tokens=False):
            ends[i] = True
    if tokenizer.eos_id is not None:
        ends[tokenizer.eos_id] = True
    return ends


def complete_blocks(tokens, is_end: np.ndarray, block_size: int) -> np.ndarray:
    """``int64[N, 2]``: ``[start, end)`` of blocks of whole sentences, at most ``block_size`` tokens each.

    Args:
        tokens: 1-D integer array ``[L]``.
        is_end: ``bool[vocab]``, from :func:`line_end_ids`.
        block_size: most tokens in a block.
    """
    tokens = _check_tokens(tokens)
    block_size = _check_pos_int("block_size", block_size)
    if not isinstance(is_end, np.ndarray) or is_end.dtype != bool or is_end.ndim != 1:
        raise TypeError("is_end must be a 1-D bool numpy array over the vocabulary (line_end_ids)")
    if len(tokens) and int(tokens.max()) >= len(is_end):
        raise ValueError(f"tokens hold id {int(tokens.max())}, past is_end's {len(is_end)} entries")
    ends = np.flatnonzero(is_end[tokens]) + 1
    if not len(ends) or ends[-1] != len(tokens):
        ends = np.append(ends, len(tokens))  # a last sentence without its end mark
    # Whole sentences greedily: a block closes before the sentence that would overflow it. The loop
    # is over sentences (about 4M for WikiText-103: seconds), not tokens.
    blocks, start, size = [], 0, 0
    prev = 0
    for end in ends.tolist():
        n = end - prev
        if size and size + n > block_size:
            blocks.append((start, prev))
            start, size = prev, 0
        if n > block_size:  # one sentence longer than a block: cut it into pieces
            for lo in range(prev, end - block_size + 1, block_size):
                blocks.append((lo, lo + block_size))
            start = prev + (n // block_size) * block_size
            size = end - start
        else:
            size += n
        prev = end
    if size:
        blocks.append((start, prev))
    return np.asarray(blocks, dtype=np.int64).reshape(-1, 2)


def _rows(tokens: np.ndarray, blocks: np.ndarray, seq_len: int, bos_id: int | None, pad_id: int) -> dict:
    ids = torch.full((len(blocks), seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros((len(blocks), seq_len), dtype=torch.long)
    first = 0 if bos_id is None else 1
    if bos_id is not None:
        ids[:, 0] = bos_id
    for r, (a, b) in enumerate(blocks.tolist()):
        ids[r, first:first + b - a] = torch.from_numpy(np.asarray(tokens[a:b], dtype=np.int64))
        mask[r, :first + b - a] = 1
    return {"input_ids": ids, "attention_mask": mask}


class BlockBatchIterator(StepBatches):
    """Training batches of whole-sentence blocks (see the module docstring).

    Args:
        tokens: 1-D integer array ``[L]`` (a token-cache memmap is not copied).
        is_end: ``bool[vocab]`` sentence ends (:func:`line_end_ids`).
        seq_len: ``T``, ``<s>`` included: blocks hold at most ``T - 1`` tokens (``T`` without ``bos_id``).
        batch_size: blocks per batch on this rank.
        bos_id: put in front of every block (None: nothing).
        pad_id: fills each row after its block.
        seed, rank, world_size, step: as :class:`~transnormer.data.lm.LMBatchIterator`.
    """

    def __init__(self, tokens, is_end: np.ndarray, seq_len: int, batch_size: int, *, bos_id: int | None,
                 pad_id: int, seed: int = 0, rank: int = 0, world_size: int = 1, step: int = 0) -> None:
        super().__init__(tokens, seq_len, batch_size, seed, rank, world_size, step)
        self.bos_id = None if bos_id is None else _check_pos_int("bos_id", bos_id, 0)
        self.pad_id = _check_pos_int("pad_id", pad_id, 0)
        self.is_end = is_end
        self._blocks: np.ndarray | None = None  # made at first use: evaluating a model needs none
        self._order: tuple[int, np.ndarray] | None = None

    @property
    def blocks(self) -> np.ndarray:
        """``int64[N, 2]``: the split's blocks (:func:`complete_blocks`)."""
        if self._blocks is None:
            blocks = complete_blocks(self.tokens, self.is_end, self.seq_len - (self.bos_id is not None))
            if len(blocks) < self.global_batch_size:
                raise ValueError(f"tokens make {len(blocks)} blocks of seq_len={self.seq_len}, fewer than "
                                 f"batch_size*world_size={self.global_batch_size}; use less data per step or more "
                                 "data")
            self._blocks = blocks
        return self._blocks

    @property
    def steps_per_epoch(self) -> int:
        return len(self.blocks) // self.global_batch_size

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.blocks)))
        return self._order[1]

    @property
    def epoch(self) -> int:
        """Epoch of the next batch."""
        return self.step // self.steps_per_epoch

    def batch_at(self, step: int) -> dict[str, torch.Tensor]:
        """This rank's batch for global ``step`` (does not move the iterator)."""
        epoch, k = divmod(_check_pos_int("step", step, 0), self.steps_per_epoch)
        lo = k * self.global_batch_size + self.rank * self.batch_size
        picked = self.blocks[self._epoch_order(epoch)[lo:lo + self.batch_size]]
        return _rows(self.tokens, picked, self.seq_len, self.bos_id, self.pad_id)

    def state_dict(self) -> dict:
        """Data position plus the settings that must match on resume."""
        return {"step": self.step, "seed": self.seed, "seq_len": self.seq_len,
                "global_batch_size": self.global_batch_size, "num_tokens": len(self.tokens),
                "tokens": self.tokens_fingerprint, "tokens_digest": self.tokens_digest, "num_blocks": len(self.blocks), "packing": "complete"}


def eval_block_batches(tokens, is_end: np.ndarray, seq_len: int, batch_size: int, *, bos_id: int | None,
                       pad_id: int, rank: int = 0, world_size: int = 1) -> Iterator[dict[str, torch.Tensor]]:
    """Every whole-sentence block of ``tokens`` once, in order; block ``i`` goes to rank
    ``i % world_size``. Yields :class:`BlockBatchIterator`'s rows plus ``"window": LongTensor[b]``,
    each block's index in the split (a masking key that does not depend on the number of ranks)."""
    tokens = _check_tokens(tokens)
    seq_len = _check_pos_int("seq_len", seq_len, 2)
    batch_size = _check_pos_int("batch_size", batch_size)
    rank, world_size = _check_shard(rank, world_size)
    bos_id = None if bos_id is None else _check_pos_int("bos_id", bos_id, 0)
    pad_id = _check_pos_int("pad_id", pad_id, 0)
    blocks = complete_blocks(tokens, is_end, seq_len - (bos_id is not None))
    mine = np.arange(rank, len(blocks), world_size)
    for lo in range(0, len(mine), batch_size):
        idx = mine[lo:lo + batch_size]
        batch = _rows(tokens, blocks[idx], seq_len, bos_id, pad_id)
        batch["window"] = torch.from_numpy(idx.astype(np.int64))
        yield batch
