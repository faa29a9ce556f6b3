"""Model family: causality, padding invariance, save/load, presets, errors, decoding."""

import pytest
import torch

from conftest import rel_err
from transnormer.models import (
    TransNormerConfig,
    TransNormerForCausalLM,
    TransNormerForMaskedLM,
    TransNormerForSequenceClassification,
    TransNormerModel,
)
from transnormer.presets import build_model, count_parameters, get_config


def small(**kw):
    base = dict(vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, block_size=8,
                chunk_size=8, dropout=0.0, max_position_embeddings=256)
    base.update(kw)
    return TransNormerConfig(**base)


@pytest.mark.parametrize("variant", ["t1", "t2"])
def test_causality_model_level(variant):
    torch.manual_seed(0)
    model = TransNormerForCausalLM(small(variant=variant)).eval()
    x = torch.randint(0, 97, (2, 40))
    base = model(x).logits
    for t in (0, 7, 8, 9, 23, 39):
        y = x.clone()
        y[:, t:] = torch.randint(0, 97, y[:, t:].shape)
        out = model(y).logits
        assert torch.allclose(out[:, :t], base[:, :t], atol=1e-6), t


@pytest.mark.parametrize("variant", ["t1", "t2"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_bidirectional_padding_invariance(variant, side):
    torch.manual_seed(0)
    cfg = get_config(f"{variant}-roberta-tiny", vocab_size=97, block_size=8, chunk_size=8, dropout=0.0,
                     attention_dropout=0.0)
    model = TransNormerModel(cfg).eval()
    x = torch.randint(3, 97, (1, 21))
    ref = model(x).last_hidden_state
    for pad in (1, 7, 19):
        ids = torch.zeros(1, 21 + pad, dtype=torch.long)
        mask = torch.zeros(1, 21 + pad, dtype=torch.bool)
        sl = slice(0, 21) if side == "right" else slice(pad, pad + 21)
        ids[:, sl], mask[:, sl] = x, True
        out = model(ids, attention_mask=mask).last_hidden_state
        assert torch.isfinite(out).all()
        assert torch.allclose(out[:, sl], ref, atol=1e-5), pad


@pytest.mark.parametrize("variant", ["t1", "t2"])
def test_causal_lm_batched_padding_equals_alone(variant):
    torch.manual_seed(0)
    model = TransNormerForCausalLM(small(variant=variant)).eval()
    a, b = torch.randint(3, 97, (1, 19)), torch.randint(3, 97, (1, 11))
    ids = torch.zeros(2, 19, dtype=torch.long)
    mask = torch.zeros(2, 19, dtype=torch.bool)
    ids[0], mask[0] = a[0], True
    ids[1, 8:], mask[1, 8:] = b[0], True  # left padding
    out = model(ids, attention_mask=mask).logits
    assert torch.allclose(out[0], model(a).logits[0], atol=1e-5)
    assert torch.allclose(out[1, 8:], model(b).logits[0], atol=1e-5)


def test_non_contiguous_mask_rejected():
    model = TransNormerModel(small())
    mask = torch.tensor([[1, 0, 1, 1]])
    with pytest.raises(ValueError, match="contiguous"):
        model(torch.ones(1, 4, dtype=torch.long), attention_mask=mask)


@pytest.mark.parametrize("cls,task_kw", [
    (TransNormerForCausalLM, {}),
    (TransNormerForMaskedLM, {"causal": False}),
    (TransNormerForSequenceClassification, {"causal": False, "num_labels": 3, "classifier_pooling": "last"}),
])
def test_save_load_round_trip(tmp_path, cls, task_kw):
    torch.manual_seed(0)
    model = cls(small(**task_kw)).eval()
    x = torch.randint(0, 97, (2, 13))
    ref = model(x).logits
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = cls.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded(x).logits, ref)


def test_auto_classes(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    TransNormerForCausalLM(small()).save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "transnormer"
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path), TransNormerForCausalLM)


@pytest.mark.parametrize("task", ["clm", "mlm", "cls"])
@pytest.mark.parametrize("return_logits", [True, False])
def test_num_items_in_batch_weighs_every_target_alike(task, return_logits):
    """HF Trainer's gradient accumulation passes num_items_in_batch: two micro-batches must give the
    gradient of one batch of both, also when they hold different numbers of targets (a per-batch
    mean had weighed a micro-batch of 2 targets as much as one of 12)."""
    if task == "cls" and not return_logits:
        pytest.skip("the classifier has no fused path")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert "TransNormerForCausalLM" in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()  # Trainer's label shift
    torch.manual_seed(0)
    kw = {"causal": task == "clm", **({"num_labels": 3} if task == "cls" else {})}
    head = {"clm": TransNormerForCausalLM, "mlm": TransNormerForMaskedLM,
            "cls": TransNormerForSequenceClassification}[task]
    m = head(small(num_hidden_layers=2, attention_dropout=0.0, **kw)).double()
    ids = torch.randint(5, 97, (4, 12))
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[:2, 3:] = 0
    if task == "clm":
        labels = ids.masked_fill(mask == 0, -100)
        items = int((labels[:, 1:] != -100).sum())
    elif task == "mlm":
        labels = torch.full_like(ids, -100)
        labels[0, 1], labels[1, 0] = ids[0, 1], ids[1, 0]
        labels[2:, ::2] = ids[2:, ::2]
        items = int((labels != -100).sum())
    else:  # a -100 label is not scored, nor counted (it had been counted: the loss scaled by 4/3)
        labels, items = torch.tensor([0, -100, 1, 1]), 3
    extra = {} if task == "cls" else {"return_logits": return_logits}

    def grads(*batches):
        m.zero_grad()
        for sl, n in batches:
            m(ids[sl], attention_mask=mask[sl], labels=labels[sl], num_items_in_batch=n, **extra).loss.backward()
        return [p.grad.clone() for p in m.parameters() if p.grad is not None]

    whole = grads((slice(0, 4), None))
    for a, b in zip(whole, grads((slice(0, 2), items), (slice(2, 4), items)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    if task != "cls":  # a micro-batch with no target adds 0, not NaN
        out = m(ids[:2], attention_mask=mask[:2], labels=torch.full_like(labels[:2], -100), num_items_in_batch=5,
                **extra).loss
        out.backward()
        assert out.item() == 0.0 and all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


@pytest.mark.parametrize("task", ["clm", "mlm"])
def test_num_items_in_batch_counting_labels_no_head_scores_warns(task):
    """HF's collators give padding the label -100 but, left-padding, keep the first real token's,
    and Trainer counts it (labels[:, 1:]); the causal head never predicts it from the pad before it
    (whose state has seen the whole row), so the loss is a sum over too large a count (4 rows with
    0/5/3/6 pads of 8: 14 targets over Trainer's 17). The head cannot correct a count of the whole
    step, so it warns; with the count matching what it scores, it is silent."""
    import warnings

    torch.manual_seed(0)
    head = TransNormerForCausalLM if task == "clm" else TransNormerForMaskedLM
    m = head(small(num_hidden_layers=1, causal=task == "clm")).double().eval()
    ids = torch.randint(5, 97, (4, 8))
    mask = torch.ones_like(ids)
    for r, pads in enumerate([0, 5, 3, 6]):
        mask[r, :pads] = 0
    if task == "clm":
        labels = ids.masked_fill(mask == 0, -100)  # as DataCollatorForLanguageModeling(mlm=False)
        trainer, scored = int((labels[:, 1:] != -100).sum()), 14
    else:  # a collator that labels a pad: Trainer counts it, the head never scores a pad
        labels = torch.full_like(ids, -100)
        labels[:, -1], labels[1, 0] = ids[:, -1], ids[1, 0]
        trainer, scored = 5, 4
    assert trainer > scored
    with torch.no_grad():
        mean = m(ids, attention_mask=mask, labels=labels).loss
        with pytest.warns(UserWarning, match="num_items_in_batch counts labels of this batch that the head does not"):
            low = m(ids, attention_mask=mask, labels=labels, num_items_in_batch=trainer).loss
        torch.testing.assert_close(low, mean * scored / trainer, rtol=1e-12, atol=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fixed = labels.masked_fill((mask == 0) | (mask.cumsum(1) == 1), -100) if task == "clm" else \
                labels.masked_fill(mask == 0, -100)
            assert int((fixed[:, 1:] if task == "clm" else fixed).ne(-100).sum()) == scored
            same = m(ids, attention_mask=mask, labels=fixed, num_items_in_batch=scored).loss
    torch.testing.assert_close(same, mean, rtol=1e-12, atol=0)


@pytest.mark.parametrize("bad, error", [
    (lambda ids, d: {"input_ids": ids.to(torch.uint8)}, "input_ids must be an int64 or int32 tensor"),
    (lambda ids, d: {"input_ids": ids.bool()}, "input_ids must be an int64 or int32 tensor"),
    (lambda ids, d: {"input_ids": ids, "attention_mask": [[1] * 6] * 2}, "attention_mask must be a torch.Tensor"),
    (lambda ids, d: {"inputs_embeds": torch.randn(2, 6, d, dtype=torch.float64)},
     "inputs_embeds must have the model's dtype torch.float32, got torch.float64"),
    (lambda ids, d: {"inputs_embeds": torch.randn(2, 6, d).bfloat16()},
     "inputs_embeds must have the model's dtype torch.float32, got torch.bfloat16"),
])
def test_inputs_of_a_wrong_type_raise_type_errors_naming_them(bad, error):
    """These had failed deep inside the embedding or the first product (RuntimeError, AttributeError)."""
    torch.manual_seed(0)
    m = TransNormerForCausalLM(small(num_hidden_layers=1)).eval()
    ids = torch.randint(5, 97, (2, 6))
    with pytest.raises(TypeError, match=error.replace("(", r"\(")):
        m(**bad(ids, m.config.hidden_size))
    m(input_ids=ids.int())  # int32 ids are the embedding's other index type
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts the products' fp32/bf16 operands itself
        m(inputs_embeds=torch.randn(2, 6, m.config.hidden_size).bfloat16())
        with pytest.raises(TypeError, match="got torch.float64"):  # (never fp64 ones)
            m(inputs_embeds=torch.randn(2, 6, m.config.hidden_size, dtype=torch.float64))
    c = TransNormerForSequenceClassification(small(num_hidden_layers=1, num_labels=3)).eval()
    with pytest.raises(TypeError, match="labels must be a torch.Tensor, got list"):
        c(ids, labels=[0, 1])


def test_config_json_loads_as_a_generic_hf_config(tmp_path):
    """HF's generic PreTrainedConfig (Trainer's resume, AutoTokenizer in a process that has not
    imported transnormer) refused ``layer_types`` holding our mixer names: it is saved as mixer_types."""
    import json

    from transformers import PretrainedConfig

    config = small(layer_types=["diag", "norm"], num_hidden_layers=2)
    TransNormerForCausalLM(config).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "layer_types" not in saved and saved["mixer_types"] == ["diag", "norm"]
    assert PretrainedConfig.from_pretrained(tmp_path).mixer_types == ["diag", "norm"]
    assert TransNormerConfig.from_pretrained(tmp_path).layer_types == ["diag", "norm"]
    saved["layer_types"] = saved.pop("mixer_types")  # a checkpoint saved before the rename
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert TransNormerConfig.from_pretrained(tmp_path).layer_types == ["diag", "norm"]


def test_tied_embeddings():
    m = TransNormerForCausalLM(small())
    assert m.lm_head.weight is m.model.embed_tokens.weight
    m = TransNormerForMaskedLM(small(causal=False))
    assert m.lm_head.decoder.weight is m.model.embed_tokens.weight


@pytest.mark.parametrize("name", ["t1-lm", "t2-lm"])
def test_lm_preset_parameter_count(name):
    n = count_parameters(name)
    assert abs(n - 156.0e6) / 156.0e6 < 0.005, n


def test_presets_shapes():
    assert get_config("t2-lm").num_hidden_layers == 6 and get_config("t2-lm").hidden_size == 512
    r = get_config("t1-roberta")
    assert (r.num_hidden_layers, r.hidden_size, r.num_attention_heads, r.pre_norm) == (12, 768, 12, False)
    assert r.layer_types == ["diag"] * 6 + ["norm"] * 6
    with pytest.raises(ValueError, match="unknown preset"):
        get_config("t3-lm")


def test_t1_t2_differ_only_in_spec_items():
    t1, t2 = build_model("t1-lm-tiny"), build_model("t2-lm-tiny")
    assert [n for n, _ in t1.named_parameters()] == [n for n, _ in t2.named_parameters()]
    a1, a2 = t1.model.layers[0].mixer, t2.model.layers[0].mixer
    assert (a1.kernel, a2.kernel) == ("relu", "softmax") and a1.norm is not None and a2.norm is None
    n1, n2 = t1.model.layers[-1].mixer, t2.model.layers[-1].mixer
    assert (n1.kernel_name, n2.kernel_name) == ("elu", "1+elu")


def test_classification_pooling_modes():
    from transnormer.models import pool

    h = torch.arange(12.0).view(1, 4, 3).repeat(2, 1, 1)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    assert torch.equal(pool(h, mask, "first")[1], h[1, 1])
    assert torch.equal(pool(h, mask, "last")[0], h[0, 2])
    assert torch.allclose(pool(h, mask, "mean")[0], h[0, :3].mean(0))


@pytest.mark.parametrize("kw,exc,word", [
    ({"layer_types": ["diag", "softmaxx", "norm", "norm"]}, ValueError, "unknown layer type"),
    ({"norm_kernel": "tanh"}, ValueError, "norm_kernel"),
    ({"norm_type": "group"}, ValueError, "norm_type"),
    ({"block_size": 0}, ValueError, "block_size"),
    ({"chunk_size": 0}, ValueError, "chunk_size"),
    ({"num_attention_heads": 5}, ValueError, "divisible"),
    ({"layer_types": ["diag"]}, ValueError, "layer_types"),
    ({"variant": "t3"}, ValueError, "variant"),
])
def test_config_errors(kw, exc, word):
    with pytest.raises(exc, match=word):
        TransNormerModel(small(**kw))


def test_input_errors():
    model = TransNormerModel(small(abs_pos="learned", max_position_embeddings=16))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(TypeError, match="int64 or int32 tensor of token ids, got torch.float32"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model(torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("variant", ["t1", "t2"])
@pytest.mark.parametrize("prompt_len", [5, 8, 9, 16])
def test_decode_equals_full_forward(variant, prompt_len):
    torch.manual_seed(0)
    model = TransNormerForCausalLM(small(variant=variant)).eval()
    x = torch.randint(0, 97, (2, 30))
    full = model(x).logits
    out = model(x[:, :prompt_len], use_cache=True)
    cache, logits = out.cache, [out.logits]
    for t in range(prompt_len, 30):
        out = model(x[:, t:t + 1], cache=cache, use_cache=True)
        cache = out.cache
        logits.append(out.logits)
    assert torch.allclose(torch.cat(logits, 1), full, atol=1e-4)


def _model_and_unchecked_grads(**kw):
    """A small causal LM, a batch, and its gradients without checkpointing (then zeroed)."""
    torch.manual_seed(0)
    model = TransNormerForCausalLM(small(dropout=0.0, **kw)).train()
    x = torch.randint(0, 97, (2, 20))
    model(x, labels=x).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return model, x, ref


def test_gradient_checkpointing_same_gradients():
    model, x, ref = _model_and_unchecked_grads()
    model.activation_checkpointing_enable()
    assert model.model.gradient_checkpointing
    model(x, labels=x).loss.backward()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref[n], atol=1e-6), n


def test_activation_checkpointing_takes_hfs_options():
    """activation_checkpointing_enable(kwargs) / Trainer's gradient_checkpointing_kwargs: the
    function HF builds from them runs each block (use_reentrant=True here); it had been ignored."""
    model, x, ref = _model_and_unchecked_grads()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    hf_fn, calls = model.model._gradient_checkpointing_func, []
    assert hf_fn.keywords == {"use_reentrant": True}
    model.model._gradient_checkpointing_func = lambda *a, **k: calls.append(1) or hf_fn(*a, **k)
    model(x, labels=x).loss.backward()
    assert len(calls) == model.config.num_hidden_layers
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref[n], atol=1e-6), n


def test_use_cache_in_training_does_not_turn_checkpointing_off():
    # use_cache=True in training had run every block without checkpointing (all activations kept),
    # silently; HF's models warn and drop the cache
    model, x, ref = _model_and_unchecked_grads()
    model.activation_checkpointing_enable()
    hf_fn, calls = model.model._gradient_checkpointing_func, []
    model.model._gradient_checkpointing_func = lambda *a, **k: calls.append(1) or hf_fn(*a, **k)
    out = model(x, labels=x, use_cache=True)
    out.loss.backward()
    assert len(calls) == model.config.num_hidden_layers and out.cache is None
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref[n], atol=1e-6), n


def test_checkpointed_blocks_compile(monkeypatch):
    """torch.compile traces a checkpointed block without call state into its checkpoint: the call
    counter and scopes had made dynamo give up on it, and every block ran eagerly (its fused CPU
    kernels, ~60 calls a step, which a traced block never makes)."""
    from transnormer.ops import _native

    model, x, ref = _model_and_unchecked_grads(num_hidden_layers=2)  # a DiagAttention block and a NormAttention one
    assert set(model.config.layer_types) == {"diag", "norm"}
    model.activation_checkpointing_enable()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    calls = []
    real = _native._call
    monkeypatch.setattr(_native, "_call", lambda name, *a: calls.append(name) or real(name, *a))
    compiled(x, labels=x).loss.backward()
    assert calls == [] or _native.load() is None  # (without the library there is nothing to step aside)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref[n], atol=1e-5), n


def test_a_masked_call_compiled_with_a_dynamic_length():
    """A constant-width mask beside ids of a dynamic length: dynamo's `width in (T, T)` compared a
    constant with symbols as unequal, and the compiled model raised 'attention_mask must be [B, T]
    = (2, 40), got (2, 40)'."""
    torch.manual_seed(0)
    model = build_model(get_config("t2-roberta-tiny", num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                   vocab_size=97), task="cls").eval()
    ids, mask = torch.randint(1, 97, (2, 40)), torch.ones(2, 40, dtype=torch.long)
    mask[1, 30:] = 0
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    torch._dynamo.maybe_mark_dynamic(ids, 1)
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids, attention_mask=mask).logits,
                                   model(input_ids=ids, attention_mask=mask).logits)


@pytest.mark.parametrize("preset,task", [("performer-lm-tiny", "clm"), ("t2-lra-listops-tiny", "cls")])
def test_gradient_checkpointing_has_no_second_side_effects(preset, task):
    """The recomputation in the backward must not redraw Performer's features (the gradient would be
    that of other features) nor update BatchNorm's running statistics a second time."""
    torch.manual_seed(0)
    overrides = {"layer_options": {"performer": {"redraw_interval": 3}}} if "performer" in preset else {}
    model = build_model(get_config(preset, dropout=0.0, **overrides), task=task).train()
    plain = build_model(get_config(preset, dropout=0.0, **overrides), task=task).train()
    plain.load_state_dict(model.state_dict())
    model.activation_checkpointing_enable()
    x = torch.randint(3, model.config.vocab_size, (2, 24))
    kw = dict(labels=x) if task == "clm" else dict(labels=torch.tensor([0, 1]))
    for _ in range(3):
        grads = []
        for m in (plain, model):
            m.zero_grad()
            m(x, **kw).loss.backward()
            grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
        for n, g in grads[0].items():
            assert torch.allclose(grads[1][n], g, atol=1e-5), n
        for (n, a), b in zip(plain.named_buffers(), model.buffers()):
            assert torch.equal(a, b), n


def test_checkpointed_performer_recomputes_with_the_features_each_forward_used():
    """Two forwards into one backward (R-Drop, two views), with a redraw between them: the
    recomputation had read the redrawn features, and the first forward's gradient was that of other
    features (a difference as large as the gradient itself)."""
    torch.manual_seed(0)
    config = get_config("performer-lm-tiny", dropout=0.0, layer_options={"performer": {"redraw_interval": 1}})
    plain, model = build_model(config).train(), build_model(config).train()
    model.load_state_dict(plain.state_dict())
    model.activation_checkpointing_enable()
    a, b = torch.randint(3, config.vocab_size, (2, 2, 9))
    grads = []
    for m in (plain, model):
        (m(a, labels=a).loss + m(b, labels=b).loss).backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_masked_batchnorm_trains_in_half_precision(dtype):
    """A model in half precision trains its batch norms (the update had refused the fp32 batch
    statistics); the running statistics stay fp32 (in fp16 the variance had overflowed)."""
    model = build_model("t2-lra-listops-tiny", task="cls", dropout=0.0).to(dtype).train()
    x = torch.randint(3, model.config.vocab_size, (2, 24))
    model(x, labels=torch.tensor([0, 1])).loss.backward()
    norms = [m for m in model.modules() if hasattr(m, "running_mean")]
    assert norms and all(torch.isfinite(m.running_mean).all() and m.running_mean.dtype == torch.float32 for m in norms)


def test_a_new_head_on_a_pretrained_body_is_initialised(tmp_path):
    """from_pretrained leaves weights the checkpoint lacks to _init_weights (the paper init included)."""
    torch.manual_seed(0)
    build_model("t2-lm-tiny", vocab_size=97).save_pretrained(tmp_path)
    model = TransNormerForSequenceClassification.from_pretrained(tmp_path, num_labels=3)
    for p in model.classifier.parameters():
        assert torch.isfinite(p).all() and p.abs().max() < 1
    assert torch.isfinite(model(torch.randint(3, 97, (2, 16))).logits).all()


def test_performer_loads_in_bf16(tmp_path):
    build_model("performer-lm-tiny", vocab_size=97).save_pretrained(tmp_path)
    model = TransNormerForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert torch.isfinite(model(torch.randint(3, 97, (1, 8))).logits.float()).all()


def test_lrpe_angles_stay_fp32_in_a_bf16_model():
    from transnormer.modules.positional import LRPE

    lrpe = LRPE(32).to(torch.bfloat16)
    positions = torch.arange(2000)
    got = lrpe.angles(positions)  # bf16 positions past 256 would round to even numbers
    assert got.dtype == torch.float32
    assert torch.equal(got, positions.float()[None, :, None] * lrpe.theta.float())


def test_classification_labels_are_checked():
    torch.manual_seed(0)
    x = torch.randint(3, 97, (2, 12))
    reg = TransNormerForSequenceClassification(small(num_labels=1, causal=False)).eval()
    y = torch.tensor([0.5, -1.0])
    assert torch.equal(reg(x, labels=y).loss, reg(x, labels=y[:, None]).loss)  # [B] or [B, 1]
    with pytest.raises(ValueError, match="regression labels"):
        reg(x, labels=torch.zeros(3))
    cls = TransNormerForSequenceClassification(small(num_labels=3, causal=False)).eval()
    assert torch.equal(cls(x, labels=torch.tensor([2, 0])).loss, cls(x, labels=torch.tensor([[2], [0]])).loss)
    with pytest.raises(ValueError, match="single-label labels"):
        cls(x, labels=torch.tensor([2, 0, 1]))
    for bad in (3, -1):  # had been an IndexError from cross_entropy (a device assert on CUDA)
        with pytest.raises(ValueError, match=rf"class indices in \[0, num_labels=3\) or -100 \(not scored\), got {bad}"):
            cls(x, labels=torch.tensor([0, bad]))
    assert torch.equal(cls(x, labels=torch.tensor([-100, 0])).loss, cls(x[1:], labels=torch.tensor([0])).loss)
    # the inferred problem type is kept in the config (HF's heads do so; pipelines read it)
    assert reg.config.problem_type == "regression" and cls.config.problem_type == "single_label_classification"
    cls.config.problem_type = None
    multi = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    expected = torch.nn.functional.binary_cross_entropy_with_logits(cls(x).logits, multi)
    assert torch.allclose(cls(x, labels=multi).loss, expected)
    assert cls.config.problem_type == "multi_label_classification"
    cls.config.problem_type = "ranking"
    with pytest.raises(ValueError, match="problem_type"):
        cls(x, labels=torch.tensor([2, 0]))


def test_attention_mask_wider_than_the_input_needs_a_cache():
    model = TransNormerForCausalLM(small()).eval()
    x = torch.randint(3, 97, (2, 16))
    with pytest.raises(ValueError, match="attention_mask must be"):
        model(x, attention_mask=torch.ones(2, 19, dtype=torch.long))
    cache = model(x, use_cache=True).cache
    model(x[:, :1], attention_mask=torch.ones(2, 17, dtype=torch.long), cache=cache, use_cache=True)  # HF decoding


def test_performer_redraw_schedule_survives_a_reload():
    """The calls since the last redraw are saved with the weights: a resumed run redraws when the
    uninterrupted one does."""
    torch.manual_seed(0)
    cfg = get_config("performer-lm-tiny", dropout=0.0, layer_options={"performer": {"redraw_interval": 3}})
    a = build_model(cfg).train()
    x = torch.randint(3, 97, (1, 8))
    for _ in range(2):
        a(x)
    b = build_model(cfg).train()
    b.load_state_dict(a.state_dict())
    for _ in range(2):
        a(x), b(x)
    redraws = [(int(m.num_redraws), int(n.num_redraws)) for m, n in zip(a.modules(), b.modules())
               if hasattr(m, "num_redraws")]
    assert redraws and all(r == (1, 1) for r in redraws)


@pytest.mark.parametrize("preset", ["t1-lm-tiny", "t2-lm-tiny"])
def test_a_built_model_keeps_the_layers_own_init(preset):
    """Spec §1/§2 init survives post_init: NormAttention's q/k/v are xavier with gain 2^-1/2 and its
    output bias 0, DiagAttention's projections xavier with gain 1 (HF never calls _init_weights on a
    layer without direct parameters, so resetting its linears there would leave PyTorch's default)."""
    import math

    torch.manual_seed(0)
    model = build_model(preset)
    d = model.config.hidden_size
    xavier = math.sqrt(2.0 / (d + d))  # std of xavier_uniform on a [d, d] weight, gain 1
    for block in model.model.layers:
        mixer = block.mixer
        gain = 2 ** -0.5 if type(mixer).__name__ == "NormAttention" else 1.0
        for proj in (mixer.q_proj, mixer.k_proj, mixer.v_proj):
            assert abs(proj.weight.std().item() / (gain * xavier) - 1) < 0.05, type(mixer).__name__
        assert not mixer.out_proj.bias.any()


def test_hf_output_controls_are_honoured():
    """return_dict=False gives the tuple (it had returned the dataclass, so ``loss, logits = ...``
    unpacked its key names), config.output_hidden_states is the default, output_attentions=True
    raises instead of returning None."""
    torch.manual_seed(0)
    model = build_model("t2-lm-tiny", vocab_size=64).eval()
    ids = torch.randint(0, 64, (2, 9))
    ref = model(input_ids=ids, labels=ids)
    loss, logits, cache = model(input_ids=ids, labels=ids, return_dict=False)  # eval mode: a cache, as HF
    assert torch.equal(loss, ref.loss) and torch.equal(logits, ref.logits) and cache.length == 9
    loss, logits = model(input_ids=ids, labels=ids, use_cache=False, return_dict=False)
    model.config.output_hidden_states = True
    assert len(model(input_ids=ids).hidden_states) == model.config.num_hidden_layers + 1
    model.config.return_dict = False
    assert isinstance(model(input_ids=ids), tuple) and isinstance(model.model(input_ids=ids), tuple)
    model.config.return_dict, model.config.output_hidden_states = True, False
    with pytest.raises(ValueError, match="output_attentions"):
        model(input_ids=ids, output_attentions=True)
    assert model.accepts_loss_kwargs is True  # HF Trainer passes num_items_in_batch (test_num_items_in_batch_...)
    mlm = build_model("t2-roberta-tiny", vocab_size=64).eval()
    loss, logits = mlm(input_ids=ids, labels=ids, return_dict=False)
    assert logits.shape == (2, 9, 64)
    cls = build_model("t2-lm-tiny", task="cls", vocab_size=64, num_labels=3).eval()
    loss, logits = cls(input_ids=ids, labels=torch.tensor([0, 2]), return_dict=False)
    assert logits.shape == (2, 3)


@pytest.mark.parametrize("new_size", [70, 50])
def test_masked_lm_resize_keeps_its_output_bias_in_step(new_size):
    torch.manual_seed(0)
    model = build_model("t2-roberta-tiny", vocab_size=64).eval()
    with torch.no_grad():
        model.lm_head.bias.normal_()
    old = model.lm_head.bias.detach().clone()
    ids = torch.randint(0, 50, (1, 7))
    model.resize_token_embeddings(new_size, mean_resizing=False)
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, 7, new_size) and model.lm_head.bias.shape == (new_size,)
    keep = min(64, new_size)
    assert torch.equal(model.lm_head.bias[:keep], old[:keep]) and not model.lm_head.bias[keep:].any()
    assert model.lm_head.decoder.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_fp64_classification_loss_stays_fp64():
    torch.manual_seed(0)
    cls = build_model("t2-lm-tiny", task="cls", vocab_size=64, num_labels=3).double().eval()
    ids, labels = torch.randint(0, 64, (2, 9)), torch.tensor([0, 2])
    with torch.no_grad():
        out = cls(input_ids=ids, labels=labels)
    assert out.loss.dtype == torch.float64
    assert float(out.loss) == pytest.approx(float(torch.nn.functional.cross_entropy(out.logits, labels)), abs=1e-15)



@pytest.mark.parametrize("initializer", ["paper", "normal"])
def test_an_encoder_loaded_as_masked_lm_gets_an_initialised_head(tmp_path, initializer):
    # from_pretrained creates weights the checkpoint lacks with torch.empty and relies on
    # _init_weights: the head's output bias (and, with "normal", its LayerNorm) were left as garbage
    from transnormer.models import TransNormerForMaskedLM

    torch.manual_seed(0)
    base = TransNormerModel(small(causal=False, initializer=initializer))
    base.save_pretrained(tmp_path)
    for _ in range(2):
        mlm = TransNormerForMaskedLM.from_pretrained(tmp_path)
        head = mlm.lm_head
        assert torch.equal(head.bias, torch.zeros_like(head.bias))
        assert torch.equal(head.norm.weight, torch.ones_like(head.norm.weight))
        assert torch.equal(head.norm.bias, torch.zeros_like(head.norm.bias))
        assert torch.equal(mlm.model.embed_tokens.weight, base.embed_tokens.weight)  # loaded, not reset
        assert torch.isfinite(mlm(torch.randint(3, 97, (2, 9))).logits).all()
    head.bias.data.fill_(0.25)
    mlm.save_pretrained(tmp_path / "mlm")
    assert torch.equal(TransNormerForMaskedLM.from_pretrained(tmp_path / "mlm").lm_head.bias, head.bias)


@pytest.mark.parametrize("field,value,match", [
    ("diag_num_attention_heads", -4, "diag_num_attention_heads must be None or an int >= 1"),
    ("diag_num_attention_heads", 2.0, "diag_num_attention_heads must be None or an int >= 1"),
    ("ffn_hidden_size", 0, "ffn_hidden_size must be None or an int >= 1"),
    ("attention_dropout", 2.0, r"attention_dropout must be a probability in \[0, 1\]"),
    ("classifier_dropout", -0.1, "classifier_dropout must be a probability"),
    ("pre_norm", "no", "pre_norm must be a bool"),
    ("layer_options", {"nrom": {}}, "unknown layer types \\['nrom'\\]"),
    ("layer_options", {"norm": 3}, "layer_options must map layer types to dicts"),
    ("norm_type", "batch", "norm_type='batch' needs causal=False"),  # batch statistics see the future
    ("num_labels", 0, "num_labels must be >= 1"),
    ("problem_type", "foo", "problem_type must be None or one of"),
    ("lrpe_seed", "a", "lrpe_seed must be an int"),
    ("lrpe_seed", 2**62, r"lrpe_seed must be in \[0, 2\*\*32\)"),  # had overflowed torch's seed in the layer
    ("tie_word_embeddings", "False", "tie_word_embeddings must be a bool"),  # the CLI's override string had tied
    ("initializer_range", -1.0, "initializer_range must be a finite number >= 0"),
    ("initializer_range", "0.02", "initializer_range must be a finite number >= 0"),
    ("abs_pos_scale", 0.0, "abs_pos_scale must be None"),
    ("abs_pos_scale", 1.0, "abs_pos_scale sets scaled_sinusoid's"),  # with the default abs_pos: scales nothing
    # a list had failed in a membership test ("unhashable type: 'list'"), naming no field
    ("variant", ["t1"], "variant must be a string, got list"),
    ("ffn_act", ["silu"], "ffn_act must be a string, got list"),
    ("norm_kernel", 3, "norm_kernel must be a string, got int"),
])
def test_config_values_are_checked(field, value, match, tmp_path):
    # these used to fail deep inside a layer, or (a truthy string, a misspelt type) be accepted
    with pytest.raises((ValueError, TypeError), match=match):
        TransNormerConfig(**{field: value}).check()
    with pytest.raises((ValueError, TypeError), match=match):  # save_pretrained had written them
        TransNormerConfig(**{field: value}).save_pretrained(tmp_path)


def test_layer_types_must_be_a_list_of_names():
    # a string had been split into characters (layer_types='nn' → ['n', 'n']); a nested list unhashable
    with pytest.raises(TypeError, match="layer_types must be a list of layer type names, got the string 'nn'"):
        TransNormerConfig(layer_types="nn", num_hidden_layers=2)
    with pytest.raises(TypeError, match=r"layer_types must hold layer type names, got \['diag'\]"):
        TransNormerConfig(layer_types=[["diag"], "norm"], num_hidden_layers=2).check()


def test_heads_divide_the_width_only_where_layers_have_heads():
    # a FLASH stack has one head of its own: hidden_size=98 had been refused for 4 heads it never uses
    from transnormer.presets import build_model

    model = build_model("flash-lm-tiny", hidden_size=96 + 2, vocab_size=50)
    assert model(torch.randint(3, 50, (1, 9))).logits.shape == (1, 9, 50)
    with pytest.raises(ValueError, match=r"hidden_size \(98\) must be divisible by the number of heads \(4\)"):
        TransNormerConfig(hidden_size=98, num_attention_heads=4, num_hidden_layers=2).check()


def test_scaled_sinusoid_alpha0_is_a_config_field():
    # flash.md §1.3: α₀ = d^-1/2 (ours) or 1 (flash-pytorch's); only the first could be built
    from transnormer.presets import build_model

    assert build_model("flash-lm-tiny").model.embed_positions.scale.item() == pytest.approx(128 ** -0.5)
    assert build_model("flash-lm-tiny", abs_pos_scale=1.0).model.embed_positions.scale.item() == 1.0


def test_get_config_refuses_a_misspelt_field():
    # PretrainedConfig kept it as a loose attribute: the 156M default model, without a word
    from transnormer.presets import count_parameters, get_config

    with pytest.raises(ValueError, match=r"get_config\('t2-lm'\): 'hiden_size' is not a TransNormerConfig field; "
                                         r"did you mean 'hidden_size'\?"):
        get_config("t2-lm", hiden_size=256)
    with pytest.raises(ValueError, match="hiden_size"):
        count_parameters("t2-lm-tiny", hiden_size=256)
    assert get_config("t2-lm-tiny", hidden_size=64, pad_token_id=0).hidden_size == 64


def test_layer_options_given_are_merged_into_the_presets():
    """--set layer_options={"flash": {...}} had replaced the preset's options of that type: FLASH lost
    its chunk size (32 → 256), linear-elu-noscale its denominator=False, flash-quad its normalizer."""
    from transnormer.presets import get_config

    flash = get_config("flash-lm-tiny").layer_options["flash"]
    got = get_config("flash-lm-tiny", layer_options={"flash": {"normalizer": "chunk"}}).layer_options
    assert got["flash"] == {**flash, "normalizer": "chunk"} and flash["chunk_size"] == 32
    noscale = get_config("linear-elu-noscale-lm-tiny", layer_options={"linear_elu": {"eps": 1e-5}})
    assert noscale.layer_options["linear_elu"] == {"denominator": False, "eps": 1e-5}
    assert get_config("t2-lm-tiny", layer_options={"norm": {"impl": "torch"}}).layer_options == {"norm": {"impl": "torch"}}
    lra = get_config("flash-lra-listops", hidden_size=64, layer_options={"flash": {"normalizer": "chunk"}})
    assert lra.layer_options["flash"]["qk_dim"] == 64  # derived from the width as without layer_options
    assert get_config("flash-lra-listops", hidden_size=64,
                      layer_options={"flash": {"qk_dim": 32}}).layer_options["flash"]["qk_dim"] == 32
    with pytest.raises(TypeError, match="layer_options must map layer types to dicts"):  # not "int is not iterable"
        get_config("flash-lra-listops", hidden_size=64, layer_options={"flash": 3}).check()


@pytest.mark.parametrize("preset,options,error,match", [
    # norm and diag had taken it: a causal LM whose mixers saw the tokens it predicts; the others
    # failed with "_build() got multiple values for keyword argument 'causal'"
    ("t2-lm-tiny", {"norm": {"causal": False}}, ValueError, r"layer_options\['norm'\]\['causal'\] = False: every mixer"),
    ("t2-lm-tiny", {"diag": {"causal": False}}, ValueError, r"layer_options\['diag'\]\['causal'\]"),
    ("vanilla-lm-tiny", {"softmax": {"causal": "true"}}, ValueError, r"\(config.causal = True\); set that instead"),
    # "false" had read as True
    ("t2-lm-tiny", {"norm": {"norm_per_head": "false"}}, TypeError, "norm_per_head must be a bool, got 'false'"),
    ("t2-lm-tiny", {"diag": {"use_norm": "false"}}, TypeError, "use_norm must be a bool"),
    ("performer-lm-tiny", {"performer": {"orthogonal": "false"}}, TypeError, "orthogonal must be a bool"),
    ("flash-lm-tiny", {"flash": {"local_branch": "false"}}, TypeError, "local_branch must be a bool"),
    ("t2-lm-tiny", {"norm": {"lrpe_learn_theta": "false"}}, TypeError, "lrpe_learn_theta must be a bool"),
    # replaced by the one derived from seed, silently
    ("performer-lm-tiny", {"performer": {"feature_seed": 7}}, ValueError, "give seed instead"),
    # errors that had named no option ("'>' not supported ...", torch's "empty(): argument 'size'", manual_seed)
    ("flash-lm-tiny", {"flash": {"chunk_size": "8"}}, ValueError, "chunk_size must be an int >= 1, got '8'"),
    ("flash-quad-lm-tiny", {"gau": {"qk_dim": 16.0}}, TypeError, "qk_dim must be an int, got 16.0"),
    ("flash-quad-lm-tiny", {"gau": {"expansion": "2"}}, TypeError, "expansion must be a finite number"),
    ("t2-lm-tiny", {"norm": {"lrpe_seed": "a"}}, ValueError, r"lrpe_seed must be an int in \[0, 2\*\*63\), got 'a'"),
    ("t2-lm-tiny", {"diag": {"lrpe_seed": -1}}, ValueError, "lrpe_seed must be an int in .* got -1"),
    ("t2-lm-tiny", {"norm": {"lrpe_seed": 2**64}}, ValueError, "lrpe_seed must be an int in"),  # (torch's overflow)
])
def test_layer_options_are_checked_by_name(preset, options, error, match):
    from transnormer.presets import build_model

    with pytest.raises(error, match=match):
        build_model(preset, layer_options=options)


@pytest.mark.parametrize("preset,kind", [("t2-lm-tiny", "norm"), ("vanilla-lm-tiny", "softmax"),
                                         ("t2-roberta-tiny", "diag")])
def test_the_models_own_causal_spelt_in_layer_options_builds_the_same_model(preset, kind):
    # (saved configs may carry it: refusing it would refuse to load them)
    from transnormer.presets import build_model, get_config

    causal = get_config(preset).causal
    torch.manual_seed(0)
    plain = build_model(preset, vocab_size=40).eval()
    torch.manual_seed(0)
    spelt = build_model(preset, vocab_size=40, layer_options={kind: {"causal": causal}}).eval()
    ids = torch.randint(3, 40, (1, 9))
    torch.testing.assert_close(spelt(ids).logits, plain(ids).logits, rtol=0, atol=0)


def test_bidirectional_batch_norm_is_allowed_and_presets_are_not_shared():
    TransNormerConfig(norm_type="batch", causal=False).check()
    from transnormer.presets import get_config

    cfg = get_config("linear-elu-noscale-lm-tiny")
    cfg.layer_options["linear_elu"]["denominator"] = True  # editing one config ...
    assert get_config("linear-elu-noscale-lm").layer_options["linear_elu"].get("denominator") is not True


def test_inputs_embeds_are_checked():
    model = TransNormerForCausalLM(small()).eval()
    for bad in (torch.randn(2, 8), torch.randn(2, 8, 16), torch.ones(2, 8, 32, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"inputs_embeds must be a floating-point \[B, T, hidden_size=32\]"):
            model(inputs_embeds=bad)


def test_token_ids_outside_the_vocabulary_are_refused():
    """An id past the vocabulary had been an IndexError inside the embedding (on CUDA a device-side
    assert that poisons the context)."""
    model = TransNormerForCausalLM(small()).eval()
    for bad in (torch.full((1, 3), 97), torch.tensor([[5, -1, 7]])):
        with pytest.raises(ValueError, match=r"input_ids must be token ids in \[0, vocab_size=97\)"):
            model(bad)
    model(torch.tensor([[0, 96]]))  # both ends of the range


@pytest.mark.parametrize("task", ["clm", "mlm"])
def test_labels_of_another_shape_or_dtype_are_refused(task):
    model = (TransNormerForCausalLM(small()) if task == "clm" else TransNormerForMaskedLM(small(causal=False))).eval()
    ids = torch.randint(0, 97, (2, 9))
    for return_logits in (True, False):
        for bad in (ids[:, 1:], ids[:1], ids.reshape(-1)):
            with pytest.raises(ValueError, match=r"labels must have the tokens' shape \[B, T\] = \[2, 9\]"):
                model(ids, labels=bad, return_logits=return_logits)
        with pytest.raises(TypeError, match="labels must be an integer tensor"):
            model(ids, labels=ids.float(), return_logits=return_logits)


def test_masked_lm_never_scores_a_padded_position():
    """The causal LM dropped targets at padding; the masked LM scored whatever labels the padding had."""
    torch.manual_seed(0)
    model = TransNormerForMaskedLM(small(causal=False)).eval()
    ids = torch.randint(3, 97, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0
    labels = ids.clone()
    labels[1, 6:] = -100
    for return_logits in (True, False):
        ref = model(ids, attention_mask=mask, labels=labels, return_logits=return_logits).loss
        junk = labels.clone()
        junk[1, 6:] = 5  # labels on the padding: ignored
        got = model(ids, attention_mask=mask, labels=junk, return_logits=return_logits).loss
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_an_empty_input_runs_with_and_without_a_cache():
    """T = 0 in eval mode (use_cache on by default) had failed in the block cache's amax."""
    model = TransNormerForCausalLM(small()).eval()
    for use_cache in (None, False):
        out = model(torch.zeros(2, 0, dtype=torch.long), use_cache=use_cache)
        assert out.logits.shape == (2, 0, 97)


def test_a_cast_to_half_precision_keeps_the_lrpe_angles_in_fp32(tmp_path):
    """model.to(bf16) had rounded θ to 8 bits: at position 2048 the first pair's angle moved by
    radians. θ and u stay fp32 through a cast down (and a grad with them) and through
    from_pretrained(dtype=bf16), which had rounded u; fp64 casts still apply."""
    model = TransNormerForCausalLM(small())
    model.save_pretrained(tmp_path)
    loaded = TransNormerForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16
    for m, ref in zip(loaded.modules(), model.modules(), strict=True):
        if type(m).__name__ == "LRPE":
            assert m.theta.dtype == m.u.dtype == torch.float32
            assert torch.equal(m.theta, ref.theta) and torch.equal(m.u, ref.u)
    lrpes = [m for m in model.modules() if type(m).__name__ == "LRPE"]
    assert lrpes and all(m.u is not None for m in lrpes)
    theta = [m.theta.detach().clone() for m in lrpes]
    lrpes[0].theta.grad = torch.ones_like(lrpes[0].theta)
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half()):
        cast(model)
        assert model.model.embed_tokens.weight.dtype != torch.float32
        for m, t in zip(lrpes, theta, strict=True):
            assert m.theta.dtype == m.u.dtype == torch.float32 and torch.equal(m.theta.detach(), t)
        assert lrpes[0].theta.grad.dtype == torch.float32
        model(torch.randint(0, 97, (1, 12)))  # runs with fp32 tables and half-precision activations
        model.float()
    model.double()
    assert all(m.theta.dtype == m.u.dtype == torch.float64 for m in lrpes)


def test_causal_lm_refuses_a_bidirectional_config():
    cfg = get_config("t2-roberta-tiny", vocab_size=50, hidden_size=32, num_attention_heads=2, num_hidden_layers=2)
    with pytest.raises(ValueError, match="needs a causal config"):
        TransNormerForCausalLM(cfg)


@pytest.mark.parametrize("task", ["mlm", "cls"])
def test_bidirectional_heads_check_position_ids(task):
    """As the causal LM does: the positions the model derives are accepted, others (packed
    sequences) refused, not silently dropped."""
    model = build_model("t2-roberta-tiny", task=task, vocab_size=50, hidden_size=32, num_attention_heads=2,
                        num_hidden_layers=2).eval()
    ids = torch.randint(3, 50, (2, 7))
    ref = model(ids).logits
    torch.testing.assert_close(model(ids, position_ids=torch.arange(7).expand(2, 7)).logits, ref)
    with pytest.raises(ValueError, match="position_ids must count the real tokens"):
        model(ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]] * 2))


@pytest.mark.parametrize("eps", ["1e-5", -1.0, float("nan"), True])
def test_config_refuses_a_bad_norm_eps(eps):
    with pytest.raises(ValueError, match="norm_eps must be None"):
        get_config("t2-lm-tiny", norm_eps=eps).check()


@pytest.mark.parametrize("return_logits", [True, False])
@pytest.mark.parametrize("pad_id", [0, 7])
def test_causal_lm_loss_ignores_padding_on_either_side(return_logits, pad_id):
    # left padding's last pad used to be scored against the first real token (6 targets instead of 5)
    torch.manual_seed(0)
    model = TransNormerForCausalLM(small()).double().eval()
    seq = torch.randint(3, 97, (6,))
    alone = model(seq[None], labels=seq[None]).loss
    for ids, mask in (
        (torch.cat([torch.full((3,), pad_id), seq]), [0, 0, 0] + [1] * 6),
        (torch.cat([seq, torch.full((3,), pad_id)]), [1] * 6 + [0, 0, 0]),
    ):
        mask = torch.tensor([mask])
        # labels = input_ids, as HF collators without -100 give: pads must not become targets either
        out = model(ids[None], attention_mask=mask, labels=ids[None], return_logits=return_logits)
        torch.testing.assert_close(out.loss, alone, rtol=1e-12, atol=1e-12)


def test_attention_mask_values_other_than_zero_and_one_are_refused():
    torch.manual_seed(0)
    model = TransNormerForSequenceClassification(small(causal=False, num_labels=3)).eval()
    ids = torch.randint(3, 97, (2, 10))
    base = torch.ones(2, 10)
    base[1, 7:] = 0
    ref = model(ids, attention_mask=base).logits
    for dtype in (torch.bool, torch.long, torch.half):  # 0/1 in any dtype is fine
        torch.testing.assert_close(model(ids, attention_mask=base.to(dtype)).logits, ref)
    with pytest.raises(ValueError, match="attention_mask must hold 1 .* and 0 .* only"):
        model(ids, attention_mask=(1 - base) * -1e9)  # HF's additive form


def test_mean_pooling_does_not_overflow_in_half():
    from transnormer.models.modeling import pool

    h = torch.full((1, 4096, 4), 20.0)
    assert torch.equal(pool(h.half(), None, "mean"), torch.full((1, 4), 20.0).half())
    h64 = torch.randn(2, 7, 4, dtype=torch.float64)  # and fp64 stays exact (it is not summed in fp32)
    torch.testing.assert_close(pool(h64, None, "mean"), h64.mean(1), rtol=1e-15, atol=1e-15)


def test_use_cache_defaults_as_in_hf_models():
    """use_cache=None: config.use_cache in eval mode, so the HF loop ``out = m(ids); m(next,
    cache=out.cache)`` continues the sequence (it returned no cache, and the next call then read its
    token alone at position 0); a given cache is always continued; training mode builds none."""
    from transnormer.models import TransNormerCache

    torch.manual_seed(0)
    model = TransNormerForCausalLM(small()).double().eval()
    ids = torch.randint(3, 97, (2, 12))
    full = model(ids).logits
    first = model(ids[:, :5])
    assert isinstance(first.cache, TransNormerCache)
    nxt = model(ids[:, 5:], cache=first.cache)
    torch.testing.assert_close(nxt.logits, full[:, 5:], rtol=1e-10, atol=1e-10)
    assert nxt.cache.length == 12
    assert model(ids, use_cache=False).cache is None
    model.config.use_cache = False
    assert model(ids).cache is None
    model.config.use_cache = True
    assert model.train()(ids).cache is None
    assert TransNormerForSequenceClassification(small(causal=False, num_labels=2)).eval()(ids).logits.shape == (2, 2)


def test_generate_refuses_a_cache_without_use_cache():
    # HF feeds the whole sequence each step without a cache: the given prefix was counted twice
    torch.manual_seed(0)
    model = TransNormerForCausalLM(small()).eval()
    ids = torch.randint(3, 97, (1, 6))
    prefix = model(ids[:, :4], use_cache=True).cache
    with pytest.raises(ValueError, match="generate\\(\\) with a cache needs use_cache=True"):
        model.generate(ids, cache=prefix, use_cache=False, max_new_tokens=2, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("option", [{"normalizer": "seq_len"}, {"rel_bias": "toeplitz_moving"}])
def test_use_cache_default_skips_models_that_cannot_decode(option):
    """A GAU whose options need the whole sequence cannot decode: eval-mode model(ids) must run
    without a cache, not raise (the use_cache=None default had turned the cache on)."""
    model = build_model("flash-quad-lm-tiny", vocab_size=97, layer_options={"gau": option}).eval()
    ids = torch.randint(3, 97, (1, 12))
    out = model(ids)
    assert out.cache is None and out.logits.shape == (1, 12, 97)
    with pytest.raises(ValueError, match="decod"):
        model(ids, use_cache=True)


def test_layers_a_checkpoint_lacks_get_their_own_init(tmp_path):
    """from_pretrained into a deeper model (or other layer types) had left the new layers'
    projections and LRPE as uninitialised memory: NaN logits. HF skips a layer without direct
    parameters and asks _init_weights for its linears, which now run their layer's init."""
    from transnormer.presets import build_model

    torch.manual_seed(0)
    saved = build_model("t2-lm-tiny", vocab_size=61)
    saved.save_pretrained(tmp_path)
    assert saved.config.num_hidden_layers == 4
    types = ["diag", "diag", "norm", "norm", "norm", "softmax"]  # layers 4 and 5: not in the checkpoint
    loaded = TransNormerForCausalLM.from_pretrained(tmp_path, num_hidden_layers=6, layer_types=types)
    fresh = build_model("t2-lm-tiny", vocab_size=61, num_hidden_layers=6, layer_types=types)
    for name, t in [*loaded.named_parameters(), *loaded.named_buffers()]:
        assert torch.isfinite(t).all(), name
    for a, b in zip(saved.model.layers[0].parameters(), loaded.model.layers[0].parameters(), strict=True):
        assert torch.equal(a, b)  # what the checkpoint held stays
    new, ref = loaded.model.layers[4].mixer, fresh.model.layers[4].mixer
    assert torch.equal(new.lrpe.u, ref.lrpe.u) and torch.equal(new.lrpe.theta, ref.lrpe.theta)
    assert torch.equal(new.out_proj.bias, torch.zeros_like(new.out_proj.bias))  # the layer's init, not the default
    for name in ("q_proj.weight", "out_proj.weight"):
        got, want = (dict(m.named_parameters())[name].std().item() for m in (new, ref))
        assert abs(got / want - 1) < 0.2, name
    assert torch.isfinite(loaded(torch.randint(3, 61, (2, 9))).logits).all()


def test_build_model_from_a_config_takes_the_head_it_names(tmp_path):
    from transnormer.models import TransNormerConfig
    from transnormer.presets import build_model, get_config

    cfg = get_config("t2-roberta-tiny", num_labels=3)
    build_model(cfg, task="cls").save_pretrained(tmp_path)
    loaded = TransNormerConfig.from_pretrained(tmp_path)
    # a saved classifier's config had come back as a masked LM
    assert isinstance(build_model(loaded), TransNormerForSequenceClassification)
    assert isinstance(build_model(get_config("t2-lm-tiny")), TransNormerForCausalLM)
    with pytest.raises(TypeError, match=r"overrides with a preset name, not with a config: set \['hidden_size'\]"):
        build_model(cfg, hidden_size=64)  # had been ignored


def test_t1_trains_in_fp16_without_nan():
    # T1's ReLA block: a block's first query whose only score is negative gives a zero row; its SimpleRMSNorm
    # gradient dy/eps overflowed fp16, and 0 * inf made every gradient NaN (3 of 6 sequences at T = 512)
    from transnormer.presets import build_model

    torch.manual_seed(0)
    model = build_model("t1-lm-tiny", vocab_size=64, num_hidden_layers=2, hidden_size=64).half()
    bad = 0
    for seed in range(4):
        model.zero_grad()
        ids = torch.randint(0, 64, (1, 512), generator=torch.Generator().manual_seed(seed))
        model(ids, labels=ids).loss.backward()
        bad += not all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert bad == 0


def test_mlm_head_norm_gradients_are_summed_in_fp32_under_bf16():
    # CPU autocast leaves layer_norm in bf16, whose backward sums the gain/bias gradients over the rows in
    # bf16: 1e-1 relative at 16k rows. The head's norm now runs in fp32.
    from transnormer.presets import build_model

    torch.manual_seed(0)
    model = build_model("t2-roberta-tiny", vocab_size=64, num_hidden_layers=1, hidden_size=32, dropout=0.0,
                        attention_dropout=0.0)
    ids = torch.randint(5, 64, (16, 1024))
    labels = torch.where(torch.rand(ids.shape) < 0.5, ids, -100)

    def grads(autocast):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(ids, labels=labels).loss.backward()
        return model.lm_head.norm.weight.grad.clone(), model.lm_head.norm.bias.grad.clone()

    for got, ref in zip(grads(True), grads(False), strict=True):
        assert rel_err(got, ref) < 3e-2, rel_err(got, ref)


def test_a_bf16_models_embedding_norm_sums_its_gradients_in_fp32():
    # the embedding LayerNorm was torch's, whose CPU kernel sums gain/bias gradients over the rows in
    # the input's dtype: 20-64% off in a bf16 model (the head's norm, the library's own, 0.3%)
    import copy

    from transnormer.presets import build_model

    torch.manual_seed(0)
    model = build_model("t2-roberta-tiny", vocab_size=64, num_hidden_layers=1, hidden_size=32, dropout=0.0,
                        attention_dropout=0.0)
    assert model.config.embed_norm
    ids = torch.randint(5, 64, (16, 1024))
    labels = torch.where(torch.rand(ids.shape) < 0.5, ids, -100)
    ref, half = copy.deepcopy(model).double(), copy.deepcopy(model).to(torch.bfloat16)
    for m in (ref, half):
        m(ids, labels=labels).loss.backward()
    for name in ("weight", "bias"):
        got, want = getattr(half.model.embed_norm, name).grad, getattr(ref.model.embed_norm, name).grad
        assert rel_err(got.double(), want) < 5e-2, (name, rel_err(got.double(), want))


@pytest.mark.parametrize("preset, overrides", [
    ("t2-lm-tiny", {"norm_type": "rms"}),
    ("flash-lm-tiny", {}),  # ScaleNorm
    ("t2-lra-listops-tiny", {}),  # MaskedBatchNorm, its running statistics
    ("flash-roberta-tiny", {}),  # RoBERTa's init: γ, β and the relative bias
    ("performer-lm-tiny", {"initializer": "normal", "abs_pos": "learned"}),  # features, learned positions
    ("t2-lm-tiny", {"abs_pos": "scaled_sinusoid", "abs_pos_scale": 0.5}),  # the sinusoid's learnable scale
])
def test_every_tensor_a_checkpoint_lacks_gets_its_modules_init(tmp_path, preset, overrides):
    """Norms' gains and statistics, positions, and (under RoBERTa's init, which had returned before
    them) γ/β, relative biases and features were left as torch.empty: NaN or 1e21 values."""
    from transnormer.modules.norms import MaskedBatchNorm
    from transnormer.presets import build_model

    torch.manual_seed(0)
    saved = build_model(preset, vocab_size=61, num_hidden_layers=1, **overrides)
    if any(isinstance(m, MaskedBatchNorm) for m in saved.modules()):
        saved.train()(torch.randint(3, 61, (4, 16)))  # running statistics that differ from a fresh norm's
    saved.save_pretrained(tmp_path)
    kind = saved.config.layer_types[0]
    loaded = type(saved).from_pretrained(tmp_path, num_hidden_layers=2, layer_types=[kind, kind])
    torch.manual_seed(1)
    fresh = build_model(preset, vocab_size=61, num_hidden_layers=2, layer_types=[kind, kind], **overrides)
    tensors = lambda m: {**dict(m.named_parameters()), **dict(m.named_buffers())}  # noqa: E731
    old, new, ref = (tensors(m) for m in (saved, loaded, fresh))
    for name, t in new.items():
        assert torch.isfinite(t.float()).all(), name
        if name in old:
            assert torch.equal(t, old[name]), name  # what the checkpoint held stays
    for name, t in tensors(loaded.model.layers[1]).items():
        want = tensors(fresh.model.layers[1])[name]
        if t.numel() == 1 or name.endswith(("weight", "scale")) and "norm" in name or "running" in name:
            assert torch.equal(t, want), name  # deterministic inits: the fresh model's
        elif t.is_floating_point() and t.numel() > 8 and want.std() > 0:
            assert 0.5 < (t.std() / want.std()).item() < 2, name  # drawn: the same spread
    if "abs_pos_scale" in overrides:
        assert new["model.embed_positions.scale"] == ref["model.embed_positions.scale"]


@pytest.mark.parametrize("task", ["clm", "mlm"])
def test_labels_of_any_integer_dtype_and_out_of_range_ones(task):
    # int32 labels had failed inside cross_entropy (the fused causal path took them), uint8 in the -100
    # fill, and an id past the vocabulary with an IndexError from the loss
    from transnormer.presets import build_model

    torch.manual_seed(0)
    model = build_model("t2-lm-tiny" if task == "clm" else "t2-roberta-tiny", vocab_size=50).eval()
    ids = torch.randint(3, 50, (2, 7))
    want = model(ids, labels=ids).loss
    for dtype in (torch.int32, torch.int16, torch.uint8):
        torch.testing.assert_close(model(ids, labels=ids.to(dtype)).loss, want)
    bad = ids.clone()
    bad[1, 3] = 60
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 50\) or equal -100.*got 60"):
        model(ids, labels=bad)
    # a label that is never read (a padded position's; the causal head's first column) may be anything
    mask = torch.ones_like(ids)
    mask[1, 3:] = 0
    unread = ids.clone()
    unread[1, 3:] = -1
    unread[:, 0] = -7 if task == "clm" else unread[:, 0]
    assert torch.isfinite(model(ids, attention_mask=mask, labels=unread).loss)
    model.config.output_attentions = True  # HF's convention: read when the call does not say (it had been ignored)
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        model(ids)


def test_t1_trains_under_fp16_autocast_without_nan():
    # under fp16 autocast DiagAttention's fp32 guard did nothing: block_attn returned fp16 to the norm,
    # whose dy/eps on a dead row overflowed, and every gradient went NaN (model.half() was fine)
    from transnormer.presets import build_model

    torch.manual_seed(0)
    model = build_model("t1-lm-tiny", dropout=0.0)
    ids = torch.randint(3, model.config.vocab_size, (2, 64))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert torch.isfinite(loss) and not bad, bad


def test_every_tiny_preset_pickles():
    # the 1+elu and identity kernels were lambdas: torch.save(model) of every T2 and 1+elu model failed
    import io
    import pickle
    import re

    from transnormer.presets import PRESETS, build_model, preset_table

    table = preset_table()
    names = sorted(set(re.findall(r"[a-z0-9+\-]+-tiny", table)) | {p for p in PRESETS if p.endswith("-tiny")})
    assert len(names) > 30
    assert "| t2-lra-image | cls | 12 | 128 | 4/8 | diag,norm |" in table  # (had shown the Norm layers' 8 alone)
    for name in names:
        model = build_model(name, vocab_size=64) if "-lra-" not in name else build_model(name)
        torch.save(model, io.BytesIO())
        pickle.loads(pickle.dumps(model))
