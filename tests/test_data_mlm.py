"""Masked-LM collation: proportions, special tokens, determinism, padding."""

from __future__ import annotations

import pytest
import torch

from transnormer.data import MLMCollator, mask_tokens
from transnormer.data.mlm import pad_sequences

VOCAB, PAD, BOS, EOS, UNK, MASK = 1000, 0, 1, 2, 3, 4
SPECIALS = {PAD, BOS, EOS, UNK, MASK}


def _collator(seed=0, **kw):
    return MLMCollator(vocab_size=VOCAB, mask_id=MASK, pad_id=PAD, special_ids=SPECIALS, seed=seed, **kw)


def _batch(b=64, t=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (b, t), generator=g)
    ids[:, 0], ids[:, -1] = BOS, EOS
    ids[::4, 100:110] = UNK
    return ids


def test_proportions_and_labels():
    ids = _batch()
    out = _collator()({"input_ids": ids})
    masked, labels = out["input_ids"], out["labels"]
    special = torch.isin(ids, torch.tensor(sorted(SPECIALS)))
    selected = labels != -100
    assert not (selected & special).any(), "special tokens must never be selected"
    assert torch.equal(masked[special], ids[special])
    assert torch.equal(labels[selected], ids[selected])
    assert torch.equal(masked[~selected], ids[~selected])
    rate = selected.sum() / (~special).sum()
    assert abs(rate.item() - 0.15) < 0.01
    n = selected.sum().item()
    to_mask = (masked == MASK) & selected
    kept = (masked == ids) & selected
    random = selected & ~to_mask & ~kept
    assert abs(to_mask.sum().item() / n - 0.8) < 0.02
    assert abs(random.sum().item() / n - 0.1) < 0.02
    assert abs(kept.sum().item() / n - 0.1) < 0.02
    assert not torch.isin(masked[random], torch.tensor(sorted(SPECIALS))).any()
    assert masked.dtype == labels.dtype == torch.long


def test_deterministic_with_seed_and_resumable():
    ids = _batch(8, 64)
    a, b, c = _collator(seed=1), _collator(seed=1), _collator(seed=2)
    out_a, out_b, out_c = a({"input_ids": ids}), b({"input_ids": ids}), c({"input_ids": ids})
    assert torch.equal(out_a["input_ids"], out_b["input_ids"]) and torch.equal(out_a["labels"], out_b["labels"])
    assert not torch.equal(out_a["labels"], out_c["labels"])
    # Consecutive calls differ (the generator advances) and a restored state replays the next call.
    state = a.state_dict()
    nxt = a({"input_ids": ids})
    assert not torch.equal(nxt["labels"], out_a["labels"])
    d = _collator(seed=1)
    d.load_state_dict(state)
    assert torch.equal(d({"input_ids": ids})["labels"], nxt["labels"])


def test_list_of_examples_is_padded_and_padding_never_masked():
    examples = [{"input_ids": [BOS] + list(range(10, 10 + n)) + [EOS]} for n in (3, 50, 20)]
    out = _collator(mlm_probability=1.0)(examples)
    assert out["input_ids"].shape == (3, 52)
    assert out["attention_mask"].sum(1).tolist() == [5, 52, 22]
    pad_positions = out["attention_mask"] == 0
    assert (out["input_ids"][pad_positions] == PAD).all() and (out["labels"][pad_positions] == -100).all()
    # With p=1 every real non-special token is selected.
    assert (out["labels"] != -100).sum().item() == 3 + 50 + 20
    with pytest.raises(ValueError, match="input_ids has length 20 > max_length=16"):  # a ready batch had passed
        _collator(max_length=16)({"input_ids": torch.full((2, 20), 7)})
    assert _collator(max_length=16)({"input_ids": torch.full((2, 10), 7)})["input_ids"].shape == (2, 10)
    padded = _collator(max_length=64)(examples)
    assert padded["input_ids"].shape == (3, 64)


def test_attention_mask_respected_for_batch_dict():
    ids = _batch(2, 16)
    mask = torch.ones_like(ids)
    mask[:, 8:] = 0
    out = _collator(mlm_probability=1.0)({"input_ids": ids, "attention_mask": mask})
    assert (out["labels"][:, 8:] == -100).all()
    assert torch.equal(out["attention_mask"], mask)


def test_from_tokenizer_and_errors():
    from transnormer.data import train_bpe

    tok = train_bpe(["some text for the tokenizer " * 20], vocab_size=300)
    col = MLMCollator.from_tokenizer(tok, seed=0)
    assert col.mask_id == tok.mask_id and col.special_ids >= {0, 1, 2, 3, 4}
    with pytest.raises(ValueError, match="mlm_probability"):
        _collator(mlm_probability=1.5)
    with pytest.raises(ValueError, match="mask_fraction \\+ random_fraction"):
        _collator(mask_fraction=0.9, random_fraction=0.2)
    with pytest.raises(ValueError, match="mask_id"):
        MLMCollator(vocab_size=VOCAB, mask_id=None)
    with pytest.raises(ValueError, match="mask_id"):
        MLMCollator(vocab_size=VOCAB, mask_id=VOCAB)
    # at construction, not at the first batch
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match="max_length must be None or an int >= 1"):
            _collator(max_length=bad)
        with pytest.raises(ValueError, match="max_length must be None or an int >= 1"):
            pad_sequences([[1, 2]], 0, max_length=bad)
    with pytest.raises(ValueError, match=f"pad_id must be an id in \\[0, vocab_size={VOCAB}\\)"):
        MLMCollator(vocab_size=VOCAB, mask_id=MASK, pad_id=VOCAB)
    with pytest.raises(TypeError, match="input_ids"):
        mask_tokens(torch.zeros(4), mask_id=MASK, vocab_size=VOCAB)
    with pytest.raises(TypeError, match="input_ids"):
        mask_tokens(torch.zeros(2, 4), mask_id=MASK, vocab_size=VOCAB)
    for bad in (-1, VOCAB):  # an id outside the vocabulary had been masked and labelled as it was
        with pytest.raises(ValueError, match=f"input_ids must lie in \\[0, vocab_size={VOCAB}\\)"):
            mask_tokens(torch.tensor([[5, bad]]), mask_id=MASK, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"seqs\[1\] must be 1-D"):  # its rows had been run together
        pad_sequences([[1, 2], [[3, 4], [5, 6]]], pad_id=0)
    with pytest.raises(ValueError, match="pad_id"):
        MLMCollator(vocab_size=VOCAB, mask_id=MASK)([{"input_ids": [5, 6]}])
    with pytest.raises(TypeError, match=r"batch\[1\]"):
        _collator()([{"input_ids": [5]}, {"ids": [6]}])


def test_float_ids_and_masks_are_refused():
    # cast to long before any check: ids [5.9, 6.7, 7.2] had become [5, 6, 7] (then masked), and a
    # mask of 0.6 had become 0
    collate = _collator()
    with pytest.raises(TypeError, match="input_ids must hold integers"):
        collate({"input_ids": [[5.9, 6.7, 7.2]]})
    with pytest.raises(TypeError, match="attention_mask must hold integers"):
        collate({"input_ids": [[5, 6, 7]], "attention_mask": [[0.6, 1.0, 1.0]]})
    with pytest.raises(TypeError, match="input_ids must hold integers"):
        collate({"input_ids": [[True, False]]})
    out = collate({"input_ids": [[5, 6, 7]], "attention_mask": [[True, True, False]]})  # a bool mask is a mask
    assert out["input_ids"].shape == (1, 3)
    with pytest.raises(TypeError, match=r"seqs\[1\] must hold integers"):
        pad_sequences([[1, 2], [3.7]], 0)
