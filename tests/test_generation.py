"""Generation with the recurrent caches: HF generate(), batching, constant-size state."""

import pytest
import torch

from transnormer.models import TransNormerCache
from transnormer.presets import build_model

GEN = dict(pad_token_id=0, eos_token_id=None)


@pytest.fixture(scope="module", params=["t1-lm-tiny", "t2-lm-tiny"])
def model(request):
    torch.manual_seed(0)
    return build_model(request.param, vocab_size=61, dropout=0.0, block_size=8, chunk_size=8).eval()


def test_greedy_with_cache_equals_without(model):
    ids = torch.randint(3, 61, (2, 11))
    a = model.generate(ids, max_new_tokens=12, do_sample=False, **GEN)
    b = model.generate(ids, max_new_tokens=12, do_sample=False, use_cache=False, **GEN)
    assert torch.equal(a, b)


def test_beam_search_with_cache_equals_without(model):
    ids = torch.randint(3, 61, (2, 6))
    a = model.generate(ids, max_new_tokens=9, num_beams=3, do_sample=False, **GEN)
    b = model.generate(ids, max_new_tokens=9, num_beams=3, do_sample=False, use_cache=False, **GEN)
    assert torch.equal(a, b)


def test_sampling_is_seeded(model):
    ids = torch.randint(3, 61, (1, 5))
    torch.manual_seed(1)
    a = model.generate(ids, max_new_tokens=8, do_sample=True, top_p=0.9, temperature=0.7, **GEN)
    torch.manual_seed(1)
    b = model.generate(ids, max_new_tokens=8, do_sample=True, top_p=0.9, temperature=0.7, **GEN)
    assert torch.equal(a, b) and a.shape == (1, 13)


def test_batched_left_padded_equals_alone(model):
    p1, p2 = torch.randint(3, 61, (1, 13)), torch.randint(3, 61, (1, 5))
    ids = torch.zeros(2, 13, dtype=torch.long)
    mask = torch.zeros(2, 13, dtype=torch.long)
    ids[0], mask[0] = p1[0], 1
    ids[1, 8:], mask[1, 8:] = p2[0], 1
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, **GEN)
    alone1 = model.generate(p1, max_new_tokens=10, do_sample=False, **GEN)
    alone2 = model.generate(p2, max_new_tokens=10, do_sample=False, **GEN)
    assert torch.equal(batched[0, 13:], alone1[0, 13:])
    assert torch.equal(batched[1, 13:], alone2[0, 5:])


def test_eos_stops_generation(model):
    ids = torch.randint(3, 61, (1, 4))
    first = model.generate(ids, max_new_tokens=1, do_sample=False, **GEN)[0, -1].item()
    out = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=first)
    assert out.shape[1] == 5


def _cache_sizes(cache: TransNormerCache):
    return [{k: tuple(v.shape) for k, v in c.items()} for c in cache.layers]


def test_cache_is_constant_size():
    torch.manual_seed(0)
    model = build_model("t2-lm-tiny", vocab_size=61, dropout=0.0).eval()
    block = model.config.block_size
    sizes = {}
    with torch.no_grad():
        for n in (10, 5000):
            out = model(torch.randint(3, 61, (1, n)), use_cache=True)
            cache = out.cache
            for _ in range(3):
                out = model(torch.randint(3, 61, (1, 1)), cache=cache, use_cache=True)
                cache = out.cache
            sizes[n] = _cache_sizes(cache)
            for layer, c in zip(model.model.layers, cache.layers):
                if layer.mixer.__class__.__name__ == "DiagAttention":
                    assert c["k"].shape[1] <= block and int(c["valid"].sum()) <= block
    assert sizes[10] == sizes[5000]
    norm_state = [s for s in sizes[10] if "state" in s]
    assert norm_state and norm_state[0]["state"] == (1, 4, 32, 32)


CAUSAL_TINY = ["vanilla-lm-tiny", "linear-elu-lm-tiny", "performer-lm-tiny", "cosformer-lm-tiny", "flash-quad-lm-tiny",
               "flash-lm-tiny"]


@pytest.mark.parametrize("name", CAUSAL_TINY)
def test_baseline_batched_generation_equals_alone(name):
    torch.manual_seed(0)
    model = build_model(name, vocab_size=61, dropout=0.0, hidden_size=32, num_attention_heads=2).eval()
    p1, p2 = torch.randint(3, 61, (1, 11)), torch.randint(3, 61, (1, 4))
    ids = torch.zeros(2, 11, dtype=torch.long)
    mask = torch.zeros(2, 11, dtype=torch.long)
    ids[0], mask[0] = p1[0], 1
    ids[1, 7:], mask[1, 7:] = p2[0], 1
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **GEN)
    assert torch.equal(batched[0, 11:], model.generate(p1, max_new_tokens=6, do_sample=False, **GEN)[0, 11:])
    assert torch.equal(batched[1, 11:], model.generate(p2, max_new_tokens=6, do_sample=False, **GEN)[0, 4:])
