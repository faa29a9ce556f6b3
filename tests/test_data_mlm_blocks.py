"""Whole-sentence MLM blocks (fairseq's --sample-break-mode complete): packing, batches, resume, ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transnormer.data import train_bpe
from transnormer.data.mlm_blocks import BlockBatchIterator, complete_blocks, eval_block_batches, line_end_ids

END = 1  # the sentence-end id of the hand-made streams below
IS_END = np.zeros(50, dtype=bool)
IS_END[END] = True


def stream(lengths, seed=0):
    """Sentences of the given lengths (each's last token is END), ids 2..49 inside."""
    rng = np.random.default_rng(seed)
    return np.concatenate([np.append(rng.integers(2, 50, n - 1), END) for n in lengths]).astype(np.int64)


def sentence_bounds(tokens):
    ends = np.flatnonzero(IS_END[tokens]) + 1
    return set(ends.tolist()) | {0, len(tokens)}


def test_hand_case():
    # sentences of 3, 4, 2, 9 (longer than a block of 5), 1 tokens
    tokens = stream([3, 4, 2, 9, 1])
    # 3 | 4 (4+2 > 5) | 2 | the 9-token sentence's first 5 | its 4-token rest + the 1
    assert complete_blocks(tokens, IS_END, 5).tolist() == [[0, 3], [3, 7], [7, 9], [9, 14], [14, 19]]
    # 3 | 4+2 | the 9-token sentence's first 6 | its 3-token rest + the 1
    assert complete_blocks(tokens, IS_END, 6).tolist() == [[0, 3], [3, 9], [9, 15], [15, 19]]


@pytest.mark.parametrize("block", [1, 4, 7, 16, 64])
def test_blocks_tile_the_stream_with_whole_sentences_greedily(block):
    rng = np.random.default_rng(block)
    lengths = rng.integers(1, 20, 300).tolist()
    tokens = stream(lengths, seed=block)
    blocks = complete_blocks(tokens, IS_END, block)
    starts, ends = blocks[:, 0], blocks[:, 1]
    assert starts[0] == 0 and ends[-1] == len(tokens) and (starts[1:] == ends[:-1]).all()  # a tiling
    assert ((ends - starts) >= 1).all() and ((ends - starts) <= block).all()
    bounds = sentence_bounds(tokens)
    sentence_of = np.searchsorted(sorted(bounds), np.arange(len(tokens)), side="right")
    for a, b in blocks.tolist():
        if b not in bounds:  # a cut inside a sentence: only of one longer than a block, at a full block
            assert b - a == block and sentence_of[a] == sentence_of[b - 1] == sentence_of[b]
    for (a, b), (_, d) in zip(blocks[:-1].tolist(), blocks[1:].tolist(), strict=True):
        if b in bounds and a in bounds:  # greedy: the next whole sentence did not fit
            nxt = min(x for x in bounds if x > b)
            assert nxt - a > block or nxt > d


def test_blocks_errors():
    with pytest.raises(TypeError, match="is_end must be a 1-D bool"):
        complete_blocks(stream([3]), [True], 4)
    with pytest.raises(ValueError, match="past is_end's 2 entries"):
        complete_blocks(stream([3]), np.zeros(2, dtype=bool), 4)
    assert complete_blocks(np.zeros(0, dtype=np.int64), IS_END, 4).shape == (0, 2)
    assert complete_blocks(np.array([5, 6, 7]), IS_END, 4).tolist() == [[0, 3]]  # no end mark at the end
    # evaluation's ids as training's: pad_id None failed inside torch, 0.5 was cast to 0
    for kw, err in (({"pad_id": None}, TypeError), ({"pad_id": 0.5}, TypeError), ({"bos_id": -1}, ValueError)):
        with pytest.raises(err, match=next(iter(kw))):
            next(eval_block_batches(stream([3]), IS_END, 8, 2, **{"bos_id": 0, "pad_id": 49, **kw}))


def _iterator(tokens, **kw):
    base = dict(bos_id=0, pad_id=49, seed=3)
    base.update(kw)
    return BlockBatchIterator(tokens, IS_END, 8, base.pop("batch_size", 4), **base)


def test_rows_are_bos_block_padding():
    tokens = stream(np.random.default_rng(0).integers(1, 12, 200).tolist())
    it = _iterator(tokens)
    batch = it.batch_at(0)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (4, 8)
    picked = it.blocks[it._epoch_order(0)[:4]]
    for row, mask, (a, b) in zip(batch["input_ids"], batch["attention_mask"], picked.tolist(), strict=True):
        n = b - a
        assert row[0] == 0 and row[1:1 + n].tolist() == tokens[a:b].tolist() and (row[1 + n:] == 49).all()
        assert mask.tolist() == [1] * (1 + n) + [0] * (7 - n)
    no_bos = _iterator(tokens, bos_id=None)
    assert (no_bos.blocks[:, 1] - no_bos.blocks[:, 0]).max() == 8


def test_epochs_visit_each_block_once_and_ranks_split_the_global_batch():
    tokens = stream(np.random.default_rng(1).integers(1, 12, 300).tolist())
    whole = _iterator(tokens, batch_size=4)
    halves = [_iterator(tokens, batch_size=2, rank=r, world_size=2) for r in range(2)]
    seen = []
    for step in range(whole.steps_per_epoch):
        batch = whole.batch_at(step)
        parts = [h.batch_at(step)["input_ids"] for h in halves]
        assert torch.equal(torch.cat(parts), batch["input_ids"])
        seen += whole._epoch_order(0)[step * 4:(step + 1) * 4].tolist()
    assert len(set(seen)) == len(seen) == whole.steps_per_epoch * 4
    assert not torch.equal(whole.batch_at(0)["input_ids"], whole.batch_at(whole.steps_per_epoch)["input_ids"])


def test_resume_and_state_checks():
    tokens = stream(np.random.default_rng(2).integers(1, 12, 300).tolist())
    a = _iterator(tokens)
    for _ in range(5):
        next(a)
    b = _iterator(tokens)
    b.load_state_dict(a.state_dict())
    assert torch.equal(next(a)["input_ids"], next(b)["input_ids"])
    with pytest.raises(ValueError, match="seed: saved 3, now 4"):
        _iterator(tokens, seed=4).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="fewer than batch_size\\*world_size=400"):
        _iterator(tokens, batch_size=400).batch_at(0)


def test_eval_batches_cover_every_block_once_over_ranks():
    tokens = stream(np.random.default_rng(3).integers(1, 12, 100).tolist())
    n = len(complete_blocks(tokens, IS_END, 7))
    seen = []
    for rank in range(3):
        for batch in eval_block_batches(tokens, IS_END, 8, 5, bos_id=0, pad_id=49, rank=rank, world_size=3):
            seen += batch["window"].tolist()
            assert (batch["input_ids"][:, 0] == 0).all()
    assert sorted(seen) == list(range(n))


def test_line_end_ids_of_a_byte_level_bpe():
    tok = train_bpe(["first line\nsecond line\n\nnext paragraph here.\n"] * 20, vocab_size=300)
    ends = line_end_ids(tok)
    assert ends[tok.eos_id] and not ends[tok.bos_id]
    ids = tok.encode("one two\nthree four\n")
    marks = [i for i, t in enumerate(ids) if ends[t]]
    # sentence ends fall right after each newline: the prefix up to each mark decodes to whole lines
    assert [tok.decode(ids[:i + 1]).endswith("\n") for i in marks] == [True] * len(marks) and len(marks) == 2


def test_the_two_mlm_packings_refuse_each_others_resume_state():
    """An MLM checkpoint of contiguous windows must not resume on whole-sentence blocks (or back):
    the check compared only the keys both states had."""
    from transnormer.data.lm import LMBatchIterator

    tokens = stream(np.random.default_rng(4).integers(1, 12, 300).tolist())
    windows, blocks = LMBatchIterator(tokens, 8, 4), _iterator(tokens)
    with pytest.raises(ValueError, match="packing: saved 'contiguous', now 'complete'"):
        blocks.load_state_dict(windows.state_dict())
    with pytest.raises(ValueError, match="packing: saved 'complete', now 'contiguous'"):
        windows.load_state_dict(blocks.state_dict())
    old = windows.state_dict()
    del old["packing"]  # a state saved before the field: contiguous windows
    windows.load_state_dict(old)
    with pytest.raises(ValueError, match="packing: saved 'contiguous'"):
        blocks.load_state_dict(old)
