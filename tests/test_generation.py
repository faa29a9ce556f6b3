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


ALL_CAUSAL_TINY = ["t1-lm-tiny", "t2-lm-tiny", *CAUSAL_TINY]


@pytest.mark.parametrize("name", ALL_CAUSAL_TINY)
def test_prompt_as_embeddings_generates_what_the_ids_do(name):
    torch.manual_seed(0)
    model = build_model(name, vocab_size=61, dropout=0.0, hidden_size=32, num_attention_heads=2).eval()
    ids = torch.randint(3, 61, (2, 10))
    embeds = model.get_input_embeddings()(ids)
    from_embeds = model.generate(inputs_embeds=embeds, max_new_tokens=5, do_sample=False, **GEN)
    from_ids = model.generate(ids, max_new_tokens=5, do_sample=False, **GEN)
    assert torch.equal(from_embeds, from_ids[:, 10:])


@pytest.mark.parametrize("name", ALL_CAUSAL_TINY)
def test_a_cache_passed_with_use_cache_false_is_read_not_advanced(name):
    torch.manual_seed(0)
    model = build_model(name, vocab_size=61, dropout=0.0, hidden_size=32, num_attention_heads=2).eval()
    ids = torch.randint(3, 61, (3, 50))
    full = model(ids).logits
    cache = model(ids[:, :30], use_cache=True).cache
    length, seen = cache.length, cache.seen.clone()
    rest = model(ids[:, 30:], cache=cache, use_cache=False)
    assert rest.cache is None and cache.length == length and torch.equal(cache.seen, seen)
    assert (rest.logits - full[:, 30:]).abs().max() < 1e-4
    with pytest.raises(ValueError, match="cache holds 3 rows"):
        model(ids[:1, 30:31], cache=cache, use_cache=True)


def test_performer_does_not_redraw_while_decoding_in_train_mode():
    """generate() leaves the model in train mode if it was: the decoding state was built with the
    current projection, so cached calls must not draw a new one."""
    torch.manual_seed(0)
    model = build_model("performer-lm-tiny", vocab_size=61, dropout=0.0, hidden_size=32, num_attention_heads=2).train()
    layers = [m for m in model.modules() if hasattr(m, "num_redraws")]
    for m in layers:
        m.redraw_interval = 2
    cache = model(torch.randint(3, 61, (2, 7)), use_cache=True).cache
    for _ in range(5):
        cache = model(torch.randint(3, 61, (2, 1)), cache=cache, use_cache=True).cache
    assert layers and all(int(m.num_redraws) == 0 for m in layers)
    with torch.no_grad():  # generate(use_cache=False) in train mode: no cache, but no training step either
        model.generate(torch.randint(3, 61, (1, 4)), use_cache=False, max_new_tokens=6, do_sample=False,
                       pad_token_id=0)
    assert all(int(m.num_redraws) == 0 and int(m.calls_since_redraw) == 0 for m in layers)
    for _ in range(3):
        model(torch.randint(3, 61, (2, 7)))  # training calls still redraw
    assert all(int(m.num_redraws) == 1 for m in layers)


def test_flash_decoding_keeps_its_global_state_fp32_under_autocast():
    torch.manual_seed(0)
    model = build_model("flash-lm-tiny", vocab_size=61, dropout=0.0, hidden_size=32, num_attention_heads=2).eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cache = model(torch.randint(3, 61, (2, 40)), use_cache=True).cache
    states = [c[key] for c in cache.layers for key in ("s_prev", "s_cur") if c and key in c]
    assert states and all(s.dtype == torch.float32 for s in states)


def test_a_layer_with_a_cache_needs_positions():
    torch.manual_seed(0)
    model = build_model("t2-lm-tiny", vocab_size=61, dropout=0.0, hidden_size=32, num_attention_heads=2).eval()
    layer = model.model.layers[0].mixer
    x = torch.randn(2, 5, 32)
    _, layer_cache = layer(x, positions=torch.arange(5).expand(2, 5), use_cache=True)
    with pytest.raises(ValueError, match="positions must be given with a cache"):
        layer(x[:, :1], cache=layer_cache, use_cache=True)


def test_fp64_decoding_stays_fp64():
    """Step-by-step decoding in fp64 equals the full forward to fp64 rounding (DiagAttention's
    cached softmax included)."""
    torch.manual_seed(0)
    model = build_model("t2-lm-tiny", vocab_size=61, dropout=0.0, hidden_size=32, num_attention_heads=2,
                        block_size=8).eval().double()
    ids = torch.randint(3, 61, (2, 20))
    full = model(ids).logits
    cache = model(ids[:, :5], use_cache=True).cache
    steps = []
    for t in range(5, 20):
        out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
        cache = out.cache
        steps.append(out.logits)
    assert (torch.cat(steps, 1) - full[:, 5:]).abs().max() < 1e-12


def test_generation_continues_from_a_cache_passed_in(model):
    """A returned cache, or a cached prefix, handed back to generate() (transformers reads
    is_compileable / is_linear on a cache passed in): the same tokens and scores as one call.
    The new ids alone with a full-width mask (HF's convention) also work."""
    ids = torch.randint(3, 61, (1, 13))
    kw = dict(do_sample=False, return_dict_in_generate=True, output_scores=True, **GEN)
    ref = model.generate(ids, max_new_tokens=8, **kw)
    first = model.generate(ids, max_new_tokens=4, **kw)
    more = model.generate(first.sequences, cache=first.cache, max_new_tokens=4, **kw)
    assert torch.equal(more.sequences, ref.sequences)
    with torch.no_grad():
        prefix = model(input_ids=ids[:, :10], use_cache=True).cache
    got = model.generate(ids, cache=prefix, max_new_tokens=8, **kw)
    assert torch.equal(got.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(ref.scores), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        prefix = model(input_ids=ids[:, :10], use_cache=True).cache
    new_only = model.generate(ids[:, 10:], attention_mask=torch.ones(1, 13, dtype=torch.long), cache=prefix,
                              max_new_tokens=8, **kw)
    assert torch.equal(new_only.sequences[:, -8:], ref.sequences[:, -8:])
    with torch.no_grad():  # more new ids than cached ones: all of them are fed (two had been dropped)
        prefix = model(input_ids=ids[:, :2], use_cache=True).cache
    new_only = model.generate(ids[:, 2:], attention_mask=torch.ones(1, 13, dtype=torch.long), cache=prefix,
                              max_new_tokens=8, **kw)
    assert torch.equal(new_only.sequences[:, -8:], ref.sequences[:, -8:]) and new_only.cache.length == 13 + 7
    emb = model.get_input_embeddings()(ids)
    alone = model.generate(inputs_embeds=emb, max_new_tokens=8, **kw)
    with torch.no_grad():
        prefix = model(inputs_embeds=emb[:, :10], use_cache=True).cache
    got = model.generate(inputs_embeds=emb, cache=prefix, max_new_tokens=8, **kw)  # a prompt as embeddings
    assert torch.equal(got.sequences, alone.sequences)


def test_beams_and_return_sequences_from_a_cache_passed_in(model):
    # the cache held the prompt's B rows and the input B x expand_size: "the cache holds 1 rows"
    ids = torch.randint(3, 61, (1, 13))
    for kw in (dict(num_beams=3), dict(do_sample=True, num_return_sequences=2)):
        torch.manual_seed(1)
        ref = model.generate(ids, max_new_tokens=5, **kw, **GEN)
        with torch.no_grad():
            prefix = model(input_ids=ids[:, :10], use_cache=True).cache
        torch.manual_seed(1)
        assert torch.equal(model.generate(ids, cache=prefix, max_new_tokens=5, **kw, **GEN), ref)


def test_a_cache_of_the_whole_prompt_is_refused_clearly(model):
    # the next token comes from the last prompt token's logits: HF had failed with an IndexError
    ids = torch.randint(3, 61, (1, 9))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).cache
    with pytest.raises(ValueError, match="already seen all 9 tokens of the prompt"):
        model.generate(ids, cache=cache, max_new_tokens=2, do_sample=False, **GEN)
    emb = model.get_input_embeddings()(ids)
    with torch.no_grad():
        cache = model(inputs_embeds=emb, use_cache=True).cache
    with pytest.raises(ValueError, match="already seen all 9 tokens of the prompt"):
        model.generate(inputs_embeds=emb, cache=cache, max_new_tokens=2, do_sample=False, **GEN)
    for B in (1, 2):  # no cache: not the cache's fault (with B = 2 it had been an IndexError inside HF)
        with pytest.raises(ValueError, match="a prompt of at least one token"):
            model.generate(torch.empty(B, 0, dtype=torch.long), max_new_tokens=2, do_sample=False, **GEN)
        with pytest.raises(ValueError, match="a prompt of at least one token"):
            model.generate(input_ids=torch.empty(B, 0, dtype=torch.long), max_new_tokens=2, do_sample=False, **GEN)


def test_a_model_that_cannot_decode_generates_without_a_cache():
    """GAU with normalizer="seq_len" has no step form: forward's default already ran it without a
    cache, but generate() made one and failed in the first layer."""
    torch.manual_seed(0)
    model = build_model("flash-quad-lm-tiny", vocab_size=61, layer_options={"gau": {"normalizer": "seq_len"}}).eval()
    assert not any(layer.mixer.decodes for layer in model.model.layers)
    ids = torch.randint(3, 61, (2, 7))
    got = model.generate(ids, max_new_tokens=4, do_sample=False, **GEN)
    want = ids
    with torch.no_grad():
        for _ in range(4):
            want = torch.cat([want, model(want).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(got, want)
    with pytest.raises(ValueError):  # the decode API itself still refuses
        model(ids, use_cache=True)


def test_generate_returns_hidden_states_when_asked(model):
    ids = torch.randint(3, 61, (2, 5))
    out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                         output_hidden_states=True, **GEN)
    L = model.config.num_hidden_layers
    assert len(out.hidden_states) == 3 and all(len(step) == L + 1 for step in out.hidden_states)
    assert out.hidden_states[0][0].shape == (2, 5, model.config.hidden_size)  # the prompt, then one token each
    assert out.hidden_states[1][-1].shape == (2, 1, model.config.hidden_size)


def test_assisted_decoding_is_refused_clearly(model):
    with pytest.raises(ValueError, match="stateful"):
        model.generate(torch.randint(3, 61, (1, 8)), max_new_tokens=3, prompt_lookup_num_tokens=2, **GEN)


@pytest.mark.parametrize("name", ["t2-lm-tiny", "flash-lm-tiny", "vanilla-lm-tiny"])
def test_chunked_prefill_equals_whole_prefill(name):
    # generate(prefill_chunk_size=k) (transformers v5) needs a cache before its first chunk
    torch.manual_seed(0)
    model = build_model(name, vocab_size=61, dropout=0.0, hidden_size=32, num_attention_heads=2).eval()
    ids = torch.randint(3, 61, (2, 13))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    whole = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **GEN)
    chunked = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, prefill_chunk_size=3, **GEN)
    assert torch.equal(whole, chunked)


@pytest.mark.parametrize("name", ["t1-lm-tiny", "t2-lm-tiny"])
def test_a_long_chunk_on_a_cache_attends_block_by_block(monkeypatch, name):
    """DiagAttention continued with T new tokens had scored all T against all T + cache (O(T²): a
    2,048-token chunk 14x a prefill from empty); now each block of queries meets the cache and 2
    blocks of keys. The logits of real tokens equal one whole forward (left padding included)."""
    import transnormer.layers.diag_attention as diag

    torch.manual_seed(0)
    model = build_model(name, vocab_size=61, dropout=0.0, hidden_size=32, num_attention_heads=2, block_size=4,
                        chunk_size=4).eval()
    ids = torch.randint(3, 61, (2, 40))
    mask = torch.ones_like(ids)
    ids[1, :7], mask[1, :7] = 0, 0
    whole = model(ids, attention_mask=mask, use_cache=False).logits
    keys_seen = []
    real = diag._attend_within_blocks
    monkeypatch.setattr(diag, "_attend_within_blocks", lambda q, K, *a, **kw: keys_seen.append(K.shape[1]) or
                        real(q, K, *a, **kw))
    out = model(ids[:, :9], attention_mask=mask[:, :9], use_cache=True)  # 9 tokens, then 26, then 5
    logits = [out.logits]
    for lo, hi in ((9, 35), (35, 40)):
        out = model(ids[:, lo:hi], attention_mask=mask[:, :hi], cache=out.cache, use_cache=True)
        logits.append(out.logits)
    got = torch.cat(logits, 1)
    real_tokens = mask.bool()
    torch.testing.assert_close(got[real_tokens], whole[real_tokens], rtol=1e-5, atol=1e-5)
    assert keys_seen and max(keys_seen) <= 4 + 2 * 4  # the cache's block + two blocks of new keys


def test_one_run_per_row_tells_which_chunks_take_the_block_by_block_paths():
    from transnormer.layers.base import one_run_per_row

    rows = lambda *r: torch.tensor(r, dtype=torch.bool)  # noqa: E731
    assert one_run_per_row(rows([1, 1, 0], [0, 1, 1], [0, 0, 0])) and one_run_per_row(torch.zeros(2, 0, dtype=torch.bool))
    assert not one_run_per_row(rows([1, 1, 1], [1, 0, 1]))  # a gap: the dense / token-by-token paths


@pytest.mark.parametrize("normalizer", ["visible", "chunk"])
def test_flash_continues_a_chunk_of_tokens_without_a_loop_over_them(monkeypatch, normalizer):
    """FLASH continued T > 1 tokens on a cache one _step at a time (a 1,024-token prompt in 256-token
    chunks 14x its whole prefill). Now in one pass: local keys block by block, the global branch
    from per-chunk sums of the new tokens, the cache's open chunk carried on. A layer's outputs on
    real tokens equal one whole forward (relative 1e-6; dropping the carried S_cur read 2e-3 to
    4e-3) over cuts that open, close and stay inside chunks (C = 4), a padded row included."""
    from transnormer.layers.gau import FLASH

    torch.manual_seed(0)
    layer = FLASH(32, causal=True, chunk_size=4, normalizer=normalizer).eval()
    x = torch.randn(2, 40, 32)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 33:] = False
    positions = mask.long().cumsum(1) - mask.long()  # real tokens before each (the model's positions)
    step = FLASH._step
    with torch.no_grad():
        whole, _ = layer(x, attention_mask=mask)
        for cuts in ((9, 35, 40), (3, 4, 30, 40), (1, 40), (8, 21, 22, 40), (9, 11, 40)):
            o, cache = layer(x[:, :cuts[0]], attention_mask=mask[:, :cuts[0]], use_cache=True)
            outs = [o]
            for lo, hi in zip(cuts, cuts[1:]):
                if hi - lo > 1:
                    monkeypatch.setattr(FLASH, "_step", lambda *a: pytest.fail("a token at a time"))
                o, cache = layer(x[:, lo:hi], attention_mask=mask[:, lo:hi], positions=positions[:, lo:hi],
                                 cache=cache, use_cache=True)
                monkeypatch.setattr(FLASH, "_step", step)
                outs.append(o)
            err = (torch.cat(outs, 1)[mask] - whole[mask]).abs().max() / whole[mask].abs().max()
            assert err < 1e-6, (cuts, float(err))


def test_logits_to_keep_as_int_or_index_tensor():
    torch.manual_seed(0)
    model = build_model("t2-lm-tiny", vocab_size=61, dropout=0.0, hidden_size=32, num_attention_heads=2).eval()
    ids = torch.randint(3, 61, (2, 9))
    full = model(ids).logits
    assert torch.equal(model(ids, logits_to_keep=2).logits, full[:, -2:])
    assert torch.equal(model(ids, logits_to_keep=torch.tensor([0, 5])).logits, full[:, [0, 5]])
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, labels=ids, logits_to_keep=2)


def test_position_ids_are_checked_against_the_mask():
    torch.manual_seed(0)
    model = build_model("t2-lm-tiny", vocab_size=61, dropout=0.0, hidden_size=32, num_attention_heads=2).eval()
    ids = torch.randint(3, 61, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: HF's position_ids count real tokens (padding gets any value)
    hf = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    assert torch.equal(model(ids, attention_mask=mask, position_ids=hf).logits, model(ids, attention_mask=mask).logits)
    with pytest.raises(ValueError, match="position_ids must count"):  # were ignored silently
        model(ids, attention_mask=mask, position_ids=hf + 100)
    with pytest.raises(ValueError, match="position_ids must be"):
        model(ids, position_ids=torch.arange(5)[None])


def test_an_error_in_a_later_layer_leaves_the_cache_as_it_was(monkeypatch):
    """The layers' new states are committed after the last layer: a failing layer must not leave the
    caller's cache advanced in the layers before it (the next call would read them twice)."""
    torch.manual_seed(0)
    model = build_model("t2-lm-tiny", vocab_size=61, dropout=0.0, hidden_size=32, num_attention_heads=2).eval()
    ids = torch.randint(3, 61, (2, 9))
    cache = model(ids[:, :6], use_cache=True).cache
    before = ([None if c is None else dict(c) for c in cache.layers], cache.seen.clone(), cache.length)
    last = model.model.layers[-1]

    def fail(*a, **k):
        raise RuntimeError("layer failed")

    monkeypatch.setattr(last, "forward", fail)
    with pytest.raises(RuntimeError, match="layer failed"):
        model(ids[:, 6:7], cache=cache, use_cache=True)
    monkeypatch.undo()
    for old, now in zip(before[0], cache.layers, strict=True):  # the very same states, not advanced ones
        assert (old is None and now is None) or (old.keys() == now.keys() and all(old[k] is now[k] for k in old))
    assert torch.equal(before[1], cache.seen) and before[2] == cache.length
    full = model(ids).logits
    torch.testing.assert_close(model(ids[:, 6:], cache=cache, use_cache=True).logits, full[:, 6:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ALL_CAUSAL_TINY)
def test_what_padding_holds_never_reaches_a_cached_call(name):
    """A padded position's key and value get weight 0, and 0 * inf/NaN is NaN: the cached paths (a
    prefill, a chunked prefill on a cache, one step) zero them as the full forward does, so the
    logits of the real tokens are the same whatever the padding holds."""
    torch.manual_seed(0)
    model = build_model(name, vocab_size=61, dropout=0.0, hidden_size=32, num_attention_heads=2, block_size=4,
                        chunk_size=4).eval()
    embeds = model.get_input_embeddings()(torch.randint(3, 61, (2, 13)))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :5] = 0
    nxt = model.get_input_embeddings()(torch.randint(3, 61, (2, 1)))

    def logits(fill: float):
        e = embeds.masked_fill(~mask.bool()[..., None], fill)
        whole = model(inputs_embeds=e, attention_mask=mask, use_cache=True)
        step = model(inputs_embeds=nxt, attention_mask=torch.ones(2, 14, dtype=torch.long), cache=whole.cache,
                     use_cache=True)
        cache, parts = None, []
        for a in range(0, 13, 3):  # chunks on a cache, the first ones all padding in row 1
            out = model(inputs_embeds=e[:, a:a + 3], attention_mask=mask[:, :a + 3], cache=cache, use_cache=True)
            cache = out.cache
            parts.append(out.logits)
        return whole.logits, step.logits, torch.cat(parts, 1)

    real = mask.bool()
    for clean, dirty in zip(logits(0.0), logits(float("nan")), strict=True):
        keep = real[:, :clean.shape[1]] if clean.shape[1] == 13 else torch.ones(2, 1, dtype=torch.bool)
        assert torch.isfinite(dirty[keep]).all()
        torch.testing.assert_close(dirty[keep], clean[keep], atol=1e-5, rtol=1e-5)


def test_a_cache_of_another_model_is_refused_and_none_is_cropped():
    # a 4-layer cache in a 2-layer model had run on; a T2 cache in a FLASH model restarted from nothing
    from transnormer.presets import build_model

    torch.manual_seed(0)
    t2 = build_model("t2-lm-tiny", vocab_size=64).eval()
    flash = build_model("flash-lm-tiny", vocab_size=64, num_hidden_layers=t2.config.num_hidden_layers).eval()
    shallow = build_model("t2-lm-tiny", vocab_size=64, num_hidden_layers=2).eval()
    ids = torch.randint(3, 64, (1, 6))
    cache = t2(ids, use_cache=True).cache
    for other in (flash, shallow):
        with pytest.raises(ValueError, match="cache: made by another model"):
            other(ids[:, :1], cache=cache)
    assert cache.is_croppable is False  # transformers reads it (on MPS it had been an AttributeError)
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(3)
    t2(ids[:, :1], cache=cache)  # its own model goes on


def test_a_cache_of_the_same_layer_types_under_other_settings_is_refused():
    # the same layer types at another width had failed inside a layer with a shape error, and where
    # the shapes agree (T1 against T2) run on to wrong outputs; the settings that differ are named.
    # Settings compared as the layers resolve them: a kernel spelt out as its default, or heads of a
    # FLASH model (which has none), leave a cache usable. A model cast to another dtype after the
    # cache was made is named too.
    from transnormer.presets import build_model

    torch.manual_seed(0)
    t2 = build_model("t2-lm-tiny", vocab_size=64).eval()
    ids = torch.randint(3, 64, (1, 6))
    cache = t2(ids, use_cache=True).cache
    for overrides, named in (({"hidden_size": 2 * t2.config.hidden_size}, "hidden_size"),
                             ({"num_attention_heads": 2 * t2.config.num_attention_heads}, "num_attention_heads"),
                             ({"variant": "t1"}, 'norm_kernel "1\\+elu" \\(this model: "elu"\\)'),
                             ({"lrpe": "rope"}, "lrpe")):
        other = build_model("t2-lm-tiny", vocab_size=64, **overrides).eval()
        with pytest.raises(ValueError, match=f"other settings: .*{named}"):
            other(ids[:, :1], cache=cache)
    # the check runs once per cache: a model that took its own cache still refuses another one after
    wide = build_model("t2-lm-tiny", vocab_size=64, hidden_size=2 * t2.config.hidden_size).eval()
    own = wide(ids, use_cache=True).cache
    wide(ids[:, :1], cache=own)
    with pytest.raises(ValueError, match="other settings: .*hidden_size"):
        wide(ids[:, :1], cache=cache)
    wide(ids[:, :1], cache=own)
    # a model of the same widths but another vocabulary (or dropout) takes it; and generate()'s own
    # cache, the same kind, goes on in its model
    other_vocab = build_model("t2-lm-tiny", vocab_size=80, dropout=0.3).eval()
    other_vocab(ids[:, :1], cache=cache, use_cache=False)
    out = t2.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert out.sequences.shape == (1, 8)
    spelt_out = build_model("t2-lm-tiny", vocab_size=64, norm_kernel="1+elu", diag_kernel="softmax").eval()
    spelt_out.load_state_dict(t2.state_dict())
    torch.testing.assert_close(spelt_out(ids[:, :1], cache=cache, use_cache=False).logits,
                               t2(ids[:, :1], cache=cache, use_cache=False).logits)  # (read, not advanced)
    flash = build_model("flash-lm-tiny", vocab_size=64).eval()
    flash_cache = flash(ids, use_cache=True).cache
    build_model("flash-lm-tiny", vocab_size=64, num_attention_heads=1).eval()(ids[:, :1], cache=flash_cache)
    with pytest.raises(ValueError, match="made when the model was float32, its states in float32; the model is "
                                         "bfloat16 now"):
        t2.to(torch.bfloat16)(ids[:, :1], cache=cache)


@pytest.mark.parametrize("preset", ["flash-lm-tiny", "flash-quad-lm-tiny", "t2-lm-tiny"])
def test_an_empty_chunk_leaves_the_cache_as_it_was(preset):
    # FLASH had failed on a [B, 0] input (amax over an empty dim), fresh or continuing a cache
    from transnormer.presets import build_model

    model = build_model(preset, vocab_size=64).eval()
    assert model(torch.zeros(1, 0, dtype=torch.long)).logits.shape == (1, 0, 64)
    ids = torch.randint(3, 64, (2, 5))
    cache = model(ids, use_cache=True).cache
    out = model(torch.zeros(2, 0, dtype=torch.long), cache=cache)
    assert out.logits.shape == (2, 0, 64) and out.cache.length == 5
    whole = model(torch.cat([ids, ids[:, :1]], 1)).logits[:, -1]
    torch.testing.assert_close(model(ids[:, :1], cache=out.cache).logits[:, -1], whole, atol=1e-4, rtol=1e-4)
