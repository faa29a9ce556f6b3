"""Causal-LM windows, the resumable/sharded training iterator, and strided evaluation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transnormer.data import LMBatchIterator, LMWindowDataset, count_targets, eval_batches

# tokens[i] == i, so every window must be an arithmetic run and its start is its first value.
N = 10_000
TOKENS = np.arange(N, dtype=np.uint32)


def _starts(batch):
    ids = batch["input_ids"]
    assert ids.dtype == torch.long
    assert torch.equal(ids - ids[:, :1], torch.arange(ids.shape[1]).expand_as(ids)), "window not contiguous"
    return ids[:, 0].tolist()


def test_window_dataset():
    ds = LMWindowDataset(TOKENS[:103], seq_len=10)
    assert len(ds) == 10
    item = ds[3]
    assert item["input_ids"].tolist() == list(range(30, 40)) and torch.equal(item["labels"], item["input_ids"])
    assert ds[-1]["input_ids"][0] == 90
    strided = LMWindowDataset(TOKENS[:103], seq_len=10, stride=5)
    assert len(strided) == 19 and strided[1]["input_ids"][0] == 5
    with pytest.raises(IndexError):
        ds[10]
    with pytest.raises(ValueError, match="seq_len"):
        LMWindowDataset(TOKENS[:5], seq_len=10)


def test_batches_are_windows_and_epoch_covers_each_window_once():
    it = LMBatchIterator(TOKENS, seq_len=16, batch_size=4, seed=0)
    steps = it.steps_in_epoch(0)
    seen = []
    for _ in range(steps):
        b = next(it)
        assert b["input_ids"].shape == (4, 16) and torch.equal(b["labels"], b["input_ids"])
        assert set(b) == {"input_ids", "labels"}
        seen += _starts(b)
    assert len(set(seen)) == len(seen) == steps * 4
    offsets = {s % 16 for s in seen}
    assert len(offsets) == 1  # one offset per epoch
    assert it.epoch == 1
    assert all(s + 16 <= N for s in seen)
    with_mask = LMBatchIterator(TOKENS, seq_len=16, batch_size=4, attention_mask=True)
    assert torch.equal(next(with_mask)["attention_mask"], torch.ones(4, 16, dtype=torch.long))


def test_resume_gives_identical_batches():
    a = LMBatchIterator(TOKENS, seq_len=32, batch_size=8, seed=5)
    per_epoch = a.steps_in_epoch(0)
    for _ in range(per_epoch - 3):  # stop shortly before an epoch boundary
        next(a)
    state = a.state_dict()
    expected = [next(a)["input_ids"] for _ in range(8)]  # crosses into epoch 1

    b = LMBatchIterator(TOKENS, seq_len=32, batch_size=8, seed=5)
    b.load_state_dict(state)
    assert [torch.equal(x, next(b)["input_ids"]) for x in expected] == [True] * 8
    c = LMBatchIterator(TOKENS, seq_len=32, batch_size=8, seed=5, step=state["step"])
    assert torch.equal(next(c)["input_ids"], expected[0])
    assert torch.equal(a.batch_at(state["step"] + 2)["input_ids"], expected[2])
    # Another seed: another order.
    d = LMBatchIterator(TOKENS, seq_len=32, batch_size=8, seed=6, step=state["step"])
    assert not torch.equal(next(d)["input_ids"], expected[0])


def test_resume_rejects_mismatched_settings():
    a = LMBatchIterator(TOKENS, seq_len=32, batch_size=8, seed=0)
    next(a)
    with pytest.raises(ValueError, match="seq_len: saved 32, now 16"):
        LMBatchIterator(TOKENS, seq_len=16, batch_size=8).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="seed"):
        LMBatchIterator(TOKENS, seq_len=32, batch_size=8, seed=1).load_state_dict(a.state_dict())
    # Same global batch on a different number of ranks is allowed.
    b = LMBatchIterator(TOKENS, seq_len=32, batch_size=4, world_size=2, rank=1)
    b.load_state_dict(a.state_dict())
    assert b.step == 1
    with pytest.raises(TypeError, match="state"):
        b.load_state_dict({"position": 3})
    # the same number of tokens with other contents (a --data folder edited before the resume)
    edited = TOKENS.copy()
    edited[len(edited) // 2] += 1
    with pytest.raises(ValueError, match="tokens: saved"):
        LMBatchIterator(edited, seq_len=32, batch_size=8, seed=0).load_state_dict(a.state_dict())
    # one token edited away from the 4,096 sampled ones: the full digest refuses it
    picks = set(np.linspace(0, len(TOKENS) - 1, num=min(len(TOKENS), 4096)).astype(np.int64).tolist())
    unsampled = next(i for i in range(len(TOKENS)) if i not in picks)
    edited = TOKENS.copy()
    edited[unsampled] += 1
    with pytest.raises(ValueError, match="tokens_digest: saved"):
        LMBatchIterator(edited, seq_len=32, batch_size=8, seed=0).load_state_dict(a.state_dict())
    # the same tokens in another dtype are the same stream
    LMBatchIterator(TOKENS.astype(np.int64), seq_len=32, batch_size=8, seed=0).load_state_dict(a.state_dict())
    old = {k: v for k, v in a.state_dict().items() if k not in ("tokens", "tokens_digest")}  # saved before both
    LMBatchIterator(edited, seq_len=32, batch_size=8, seed=0).load_state_dict(old)


def test_rank_sharding_disjoint_and_matches_global_batch():
    full = LMBatchIterator(TOKENS, seq_len=20, batch_size=6, seed=3)
    ranks = [LMBatchIterator(TOKENS, seq_len=20, batch_size=2, seed=3, rank=r, world_size=3) for r in range(3)]
    for _ in range(full.steps_in_epoch(0) + 5):
        global_starts = _starts(next(full))
        shard_starts = [_starts(next(it)) for it in ranks]
        assert sum(shard_starts, []) == global_starts  # rank r gets the r-th slice
        assert len(set(sum(shard_starts, []))) == 6  # disjoint
    with pytest.raises(ValueError, match="rank must be < world_size"):
        LMBatchIterator(TOKENS, seq_len=20, batch_size=2, rank=3, world_size=3)


def test_no_random_offset_and_argument_errors():
    it = LMBatchIterator(TOKENS[:1000], seq_len=10, batch_size=5, random_offset=False)
    assert {s % 10 for _ in range(40) for s in _starts(next(it))} == {0}
    with pytest.raises(ValueError, match="fewer than batch_size"):
        LMBatchIterator(TOKENS[:100], seq_len=10, batch_size=10)
    with pytest.raises(TypeError, match="batch_size"):
        LMBatchIterator(TOKENS, seq_len=10, batch_size=2.0)
    with pytest.raises(ValueError, match="seq_len"):
        LMBatchIterator(TOKENS, seq_len=1, batch_size=2)
    with pytest.raises(ValueError, match="1-D"):
        LMBatchIterator(TOKENS.reshape(100, 100), seq_len=10, batch_size=2)
    with pytest.raises(TypeError, match="integers"):
        LMBatchIterator(TOKENS.astype(np.float32), seq_len=10, batch_size=2)


@pytest.mark.parametrize("stride", [None, 7, 10])
def test_eval_batches_score_each_token_once(stride):
    n, t = 1003, 10
    scored = np.zeros(n, dtype=int)
    total = 0
    for batch in eval_batches(TOKENS[:n], seq_len=t, batch_size=16, stride=stride):
        starts = _starts(batch)
        labels = batch["labels"]
        assert batch["input_ids"].shape[1] == t and labels.shape == batch["input_ids"].shape
        for row, s in enumerate(starts):
            for pos in range(1, t):  # position 0 is never a target (HF models shift labels)
                if labels[row, pos] != -100:
                    assert labels[row, pos] == s + pos
                    scored[s + pos] += 1
        total += count_targets(labels)
    assert scored.max() == 1 and total == scored.sum()
    if stride is not None and stride < t:
        assert scored[1:].min() == 1  # every token but the first is scored
    else:
        # non-overlapping: all but the window starts (the last window ends at the stream's end)
        assert total >= (n - 1) - (n // t + 1)


def test_eval_batches_sharding_and_short_streams():
    n = 500
    one = [b["input_ids"] for b in eval_batches(TOKENS[:n], 10, 4, stride=5)]
    shards = [list(eval_batches(TOKENS[:n], 10, 4, stride=5, rank=r, world_size=2)) for r in range(2)]
    all_one = torch.cat(one)
    all_shards = torch.cat([b["input_ids"] for s in shards for b in s])
    assert sorted(all_one[:, 0].tolist()) == sorted(all_shards[:, 0].tolist())
    short = list(eval_batches(TOKENS[:5], seq_len=10, batch_size=2))
    assert len(short) == 1 and short[0]["input_ids"].tolist() == [[0, 1, 2, 3, 4]]
    with pytest.raises(ValueError, match="at least 2"):
        list(eval_batches(TOKENS[:1], 10, 2))
    with pytest.raises(ValueError, match="stride must be <= seq_len=10, got 11"):
        list(eval_batches(TOKENS[:100], 10, 2, stride=11))
    # a split shorter than seq_len takes any stride up to seq_len (the one the caller set), not only the default
    for stride in (None, 5, 10):
        short = list(eval_batches(TOKENS[:5], seq_len=10, batch_size=2, stride=stride))
        assert len(short) == 1 and short[0]["input_ids"].tolist() == [[0, 1, 2, 3, 4]]
