"""LRA training side: presets (lra.md §3), the two-tower Retrieval head, the ``lra:`` task data,
provenance in results, and ``transnormer lra prepare|train|eval|report`` on small fixtures."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import on_threads, run_runs_on_two_ranks
from transnormer.cli import main
from transnormer.data.lra import TASKS, prepare
from transnormer.layers import LAYER_TYPES
from transnormer.models.dual_encoder import TransNormerDualEncoderForSequenceClassification as Dual
from transnormer.models.lra_presets import LRA_MODELS, LRA_TRAINING, lra_preset_names
from transnormer.modules.ffn import FFN
from transnormer.modules.norms import MaskedBatchNorm
from transnormer.presets import PRESETS, build_model, get_config
from transnormer.train.distributed import DistInfo
from transnormer.train.loop import TrainConfig
from transnormer.train.lra_tasks import LRAVocab, build_lra_task_data, default_root, parse_lra_spec

# lra.md §3: layers, d, Diag heads, Norm heads, FFN ratio, dropout, pooling
TABLE = {
    "listops": (4, 128, 8, 8, 4, 0.0, "mean"),
    "text": (4, 128, 8, 8, 4, 0.0, "mean"),
    "retrieval": (4, 128, 4, 8, 4, 0.0, "mean"),
    "image": (12, 128, 4, 8, 2, 0.2, "mean"),
    "pathfinder": (4, 128, 8, 8, 1, 0.0, "last"),
    "pathx": (6, 64, 8, 8, 2.5, 0.0, "last"),
}
TRAIN_TABLE = {  # lr, batch, warmup, epochs
    "listops": (1e-4, 128, 1000, 40), "text": (1e-3, 64, 80, 32), "retrieval": (1e-3, 64, 800, 20),
    "image": (1e-3, 200, 175, 200), "pathfinder": (5e-4, 128, 312, 200), "pathx": (1e-4, 64, None, None),
}


def _inputs(vocab: int, B: int = 2, T: int = 70, lengths=(70, 41)):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (B, T), generator=g)
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    return ids.masked_fill(~mask, 0), mask


@pytest.fixture(scope="module")
def listops_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("lra")
    prepare("listops", root, seed=5, n_train=96, n_val=24, n_test=24, min_length=10, max_length=60)
    return root


def _aan_fixture(root, n=(24, 8, 8)):
    g = torch.Generator().manual_seed(0)
    words = ["graph", "neural", "parse", "tree", "speech", "corpus", "model", "align"]
    for split, count in zip(("train", "eval", "test"), n):
        lines = []
        for i in range(count):
            a = " ".join(words[j] for j in torch.randint(0, 8, (int(torch.randint(5, 30, (1,), generator=g)),),
                                                         generator=g))
            b = " ".join(words[j] for j in torch.randint(0, 8, (int(torch.randint(5, 30, (1,), generator=g)),),
                                                         generator=g))
            lines.append(f"{float(i % 2)}\tid{i}a\tid{i}b\t{a}\t{b.encode()!r}")  # text2 as a bytes literal
        (root / f"new_aan_pairs.{split}.tsv").write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------- presets
def test_presets_registered_and_match_table():
    for task in TABLE:
        for name in lra_preset_names(task):
            assert name in PRESETS and PRESETS[name][0] == "cls", name
    for task, (L, d, dh, nh, r, p, pool) in TABLE.items():
        info = TASKS[task]
        for v in ("t1", "t2"):
            c = get_config(f"{v}-lra-{task}")
            assert (c.num_hidden_layers, c.hidden_size, c.diag_num_attention_heads, c.num_attention_heads) == (L, d, dh, nh)
            assert c.ffn_type == "ffn" and c.ffn_act == "gelu" and c.ffn_hidden_size == int(round(r * d))
            assert c.dropout == p and c.classifier_pooling == pool == info.pooling
            assert c.layer_types == ["diag"] * (L // 2) + ["norm"] * (L - L // 2)
            assert c.block_size == 64 and c.pre_norm and c.final_norm and c.norm_type == "batch"
            assert c.lrpe == "rope" and c.abs_pos == "sinusoidal" and not c.causal and c.variant == v
            assert c.vocab_size == info.vocab_size and c.pad_token_id == info.pad_id
            assert c.max_position_embeddings >= info.length and c.num_labels == info.num_classes
        van, fl = get_config(f"vanilla-lra-{task}"), get_config(f"flash-lra-{task}")
        assert van.layer_types == ["softmax"] * L and fl.layer_types == ["flash"] * (2 * L)
        assert get_config(f"t2-lra-{task}", norm_type="simple_rms").norm_type == "simple_rms"  # the srms option
    assert get_config("t1-lra-listops").resolved("diag_kernel") == "relu"
    assert get_config("t2-lra-listops").resolved("diag_kernel") == "softmax"
    for task, (lr, batch, warmup, epochs) in TRAIN_TABLE.items():
        t = LRA_TRAINING[task]
        assert (t["lr"], t["batch_size"], t["warmup"], t["epochs"]) == (lr, batch, warmup, epochs)
        assert (t["weight_decay"], t["schedule"], t["clip"], t["seed"]) == (0.0, "cosine", 0.0, 2222)
    assert set(LRA_MODELS) == set(TABLE)


def test_lra_presets_keep_their_ratios_at_another_width():
    # the FFN width was stored absolute: hidden_size=256 on ListOps gave a ratio of 2 (lra.md: 4)
    for task, row in TABLE.items():
        r = row[4]  # the FFN ratio
        for name in (f"t2-lra-{task}", f"t1-lra-{task}-tiny", f"vanilla-lra-{task}"):
            assert get_config(name, hidden_size=256).ffn_hidden_size == int(round(r * 256))
        assert get_config(f"t2-lra-{task}", hidden_size=256, ffn_hidden_size=100).ffn_hidden_size == 100
    assert get_config("flash-lra-listops", hidden_size=64).layer_options["flash"]["qk_dim"] == 64  # s = min(128, d)
    assert get_config("flash-lra-listops", hidden_size=512).layer_options["flash"]["qk_dim"] == 128
    assert get_config("flash-lra-listops").layer_options["flash"]["qk_dim"] == 128


@pytest.mark.parametrize("task", [t for t in TABLE if t != "retrieval"])
def test_presets_forward_reduced_length(task):
    vocab = TASKS[task].vocab_size
    ids, mask = _inputs(vocab)
    for name in (f"t2-lra-{task}", f"t1-lra-{task}-tiny", f"t2-lra-{task}-tiny"):
        # training mode: batch statistics (an untrained model's running statistics are the identity, and
        # NormAttention without a working norm overflows in deep stacks: eval needs trained statistics)
        model = build_model(name).train()
        out = model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1]))
        assert out.logits.shape == (2, TASKS[task].num_classes) and torch.isfinite(out.loss)
    blk = build_model(f"t2-lra-{task}").model.layers
    assert isinstance(blk[0].ffn, FFN) and isinstance(blk[0].mixer_norm, MaskedBatchNorm)
    assert isinstance(blk[-1].mixer.norm, MaskedBatchNorm)  # batch norm inside NormAttention too
    for kind in ("vanilla", "flash"):
        if kind == "vanilla" and "softmax" not in LAYER_TYPES or kind == "flash" and "flash" not in LAYER_TYPES:
            continue
        m = build_model(f"{kind}-lra-{task}-tiny").train()
        assert m(input_ids=ids, attention_mask=mask).logits.shape == (2, TASKS[task].num_classes)


def test_last_token_pooling_uses_last_valid_token():
    model = build_model("t2-lra-pathfinder-tiny").eval()
    ids, mask = _inputs(256, lengths=(70, 41))
    full = model(input_ids=ids, attention_mask=mask).logits
    alone = model(input_ids=ids[1:, :41]).logits
    torch.testing.assert_close(full[1:], alone, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------- retrieval head
def _dual(tiny=True):
    return Dual(get_config("t2-lra-retrieval-tiny" if tiny else "t2-lra-retrieval"))


def test_dual_encoder_forward_and_padding_invariance():
    torch.manual_seed(0)
    model = _dual()
    a, ma = _inputs(257, B=3, T=30, lengths=(30, 12, 25))
    b, mb = _inputs(257, B=3, T=45, lengths=(9, 45, 20))
    labels = torch.tensor([0, 1, 1])
    for mode in ("train", "eval"):  # masked batch norm: padding is out of the statistics in training too
        getattr(model, mode)()
        out = model(input_ids=a, attention_mask=ma, input_ids_2=b, attention_mask_2=mb, labels=labels)
        assert out.logits.shape == (3, 2) and torch.isfinite(out.loss)
        # extra padding with garbage ids, per document, changes nothing
        a2 = torch.cat([a, torch.randint(1, 257, (3, 17))], 1)
        b2 = torch.cat([b, torch.randint(1, 257, (3, 5))], 1)
        ma2 = torch.cat([ma, torch.zeros(3, 17, dtype=torch.bool)], 1)
        mb2 = torch.cat([mb, torch.zeros(3, 5, dtype=torch.bool)], 1)
        again = model(input_ids=a2, attention_mask=ma2, input_ids_2=b2, attention_mask_2=mb2).logits
        torch.testing.assert_close(again, out.logits, rtol=1e-4, atol=1e-5)
    model.eval()
    x1, x2 = model.encode_pair(a, ma, b, mb)
    one = model.encode(b[1:2, :45], mb[1:2, :45])  # a document pooled alone = pooled in the pair batch
    torch.testing.assert_close(x2[1:2], one, rtol=1e-4, atol=1e-5)
    h = model.model(input_ids=a[1:2, :12]).last_hidden_state
    torch.testing.assert_close(x1[1:2], h.mean(1), rtol=1e-4, atol=1e-5)  # mean over the valid tokens only
    feats = torch.cat([x1, x2, x1 * x2, x1 - x2], -1)
    torch.testing.assert_close(model.classifier(feats), model(input_ids=a, attention_mask=ma, input_ids_2=b,
                                                              attention_mask_2=mb).logits)
    with pytest.raises(ValueError, match="input_ids_2"):
        model(input_ids=a, attention_mask=ma)
    # a mask of another shape than its ids had been padded to the pair's length: pads read as tokens
    with pytest.raises(ValueError, match=r"attention_mask_2 must have its input_ids' shape \(3, 45\), got \(3, 30\)"):
        model(input_ids=a, attention_mask=ma, input_ids_2=b, attention_mask_2=ma)
    with pytest.raises(ValueError, match=r"attention_mask must have its input_ids' shape \(3, 30\)"):
        model(input_ids=a, attention_mask=ma[:, :12], input_ids_2=b)
    # an additive mask had been read by .bool(): real tokens where the pads are, pads where the text is
    with pytest.raises(ValueError, match="attention_mask_2 must hold 1 \\(real token\\) and 0"):
        model(input_ids=a, attention_mask=ma, input_ids_2=b, attention_mask_2=(1.0 - mb.float()) * -1e9)
    with pytest.raises(ValueError, match="attention_mask must hold 1 \\(real token\\) and 0"):
        model(input_ids=a, attention_mask=2 * ma.long(), input_ids_2=b, attention_mask_2=mb)
    # the columns a shorter document is padded with are masked: a pad id outside the vocabulary does
    model.config.pad_token_id = 10_000
    torch.testing.assert_close(model(input_ids=a, attention_mask=ma, input_ids_2=b, attention_mask_2=mb).logits,
                               model.classifier(feats))


def test_dual_encoder_loss_counts_trainers_items():
    # it declares accepts_loss_kwargs (Trainer then skips its own division by the accumulation
    # steps) and had returned each micro-batch's mean: k steps, a loss k times too large
    torch.manual_seed(0)
    model = _dual().eval()
    a, ma = _inputs(257, B=4, T=20, lengths=(20, 12, 15, 9))
    b, mb = _inputs(257, B=4, T=16, lengths=(9, 16, 10, 4))
    labels = torch.tensor([0, 1, -100, 1])

    def loss(sl, n=None):
        return model(input_ids=a[sl], attention_mask=ma[sl], input_ids_2=b[sl], attention_mask_2=mb[sl],
                     labels=labels[sl], num_items_in_batch=n).loss

    torch.testing.assert_close(loss(slice(0, 2), 3) + loss(slice(2, 4), 3), loss(slice(0, 4)))


def test_dual_encoder_save_load_round_trip(tmp_path):
    model = _dual().eval()
    a, ma = _inputs(257, B=2, T=20, lengths=(20, 7))
    b, mb = _inputs(257, B=2, T=16, lengths=(3, 16))
    ref = model(input_ids=a, attention_mask=ma, input_ids_2=b, attention_mask_2=mb).logits
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["TransNormerDualEncoderForSequenceClassification"]
    loaded = Dual.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(loaded(input_ids=a, attention_mask=ma, input_ids_2=b, attention_mask_2=mb).logits, ref)
    assert isinstance(loaded.model.layers[0].mixer_norm, MaskedBatchNorm)


def test_the_pair_heads_activation_is_a_config_field():
    # docs/lra.md offers config.pair_classifier_act; --set and get_config had refused it as no field
    from transnormer.models.configuration import check_overrides
    from transnormer.presets import get_config

    check_overrides({"pair_classifier_act": "gelu"})
    model = Dual(get_config("t2-lra-retrieval-tiny", pair_classifier_act="gelu", vocab_size=257))
    assert isinstance(model.classifier[1], torch.nn.GELU)
    assert Dual(get_config("t2-lra-retrieval-tiny", vocab_size=257)).classifier[1].__class__ is torch.nn.ReLU
    with pytest.raises(ValueError, match=r"pair_classifier_act must be one of \('relu', 'gelu', 'tanh'\), got 'elu'"):
        get_config("t2-lra-retrieval-tiny", pair_classifier_act="elu").check()


# ------------------------------------------------------------------------------------------- task data
def test_parse_spec_and_default_root():
    assert parse_lra_spec("lra:listops") == ("listops", None)
    assert parse_lra_spec("lra:path-x:/d/x") == ("pathx", "/d/x")
    assert parse_lra_spec("lra:fmnist") == ("image-fmnist32", None)
    assert default_root("listops") == "data/lra" and default_root("pathfinder") == "data/lra"
    for bad in ("listops", "lra:", "lra:nope"):
        with pytest.raises(ValueError):
            parse_lra_spec(bad)


def _ac():
    return torch.autocast("cpu", enabled=False)


def _cfg(root, task="listops", **kw):
    base = dict(task="cls", preset="t2-lra-listops-tiny", data=f"lra:{task}:{root}", seq_len=2048, batch_size=8,
                max_steps=1, seed=3)
    base.update(kw)
    return TrainConfig(**base)


def test_build_lra_task_data_listops(listops_root, tmp_path, capsys):
    info = DistInfo()
    data = build_lra_task_data(_cfg(listops_root), info, _ac)
    assert isinstance(data.tokenizer, LRAVocab) and (data.tokenizer.vocab_size, data.tokenizer.pad_id) == (17, 0)
    assert data.num_labels == 10 and data.tokens_per_step == 8 * 2048
    assert data.extra["data_provenance"] == "synthetic-fixture"
    assert data.extra["dataset_id"].startswith("listops-fixture(gen=v1, seed=5")
    assert data.extra["generator_version"] == "v1" and set(data.extra["sha256"]) >= {"basic_train.tsv"}
    # deterministic, resumable, rank-sharded
    first = [next(data.train) for _ in range(3)]
    again = build_lra_task_data(_cfg(listops_root), info, _ac)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(first, [next(again.train) for _ in range(3)]))
    again.train.load_state_dict({"step": 1})
    assert torch.equal(next(again.train)["labels"], first[1]["labels"])
    r0 = build_lra_task_data(_cfg(listops_root), DistInfo(rank=0, world_size=2), _ac)
    r1 = build_lra_task_data(_cfg(listops_root), DistInfo(rank=1, world_size=2), _ac)
    i0, i1 = r0.train.sampler.indices_at(0), r1.train.sampler.indices_at(0)
    assert not set(i0.tolist()) & set(i1.tolist())
    b = first[0]
    assert b["attention_mask"].dtype == torch.bool and (b["input_ids"][~b["attention_mask"]] == 0).all()
    # evaluation with data labels
    model = build_model("t2-lra-listops-tiny")
    res = data.evaluate(model, "valid", 2)
    assert {"loss", "accuracy", "majority_accuracy", "data_provenance", "dataset_id"} <= set(res)
    assert res["n"] == 16 and res["data_provenance"] == "synthetic-fixture" and model.training
    assert data.evaluate(model, "test", None)["n"] == 24
    data.tokenizer.save(tmp_path / "tok")
    assert LRAVocab.load(tmp_path / "tok").dataset_id == data.extra["dataset_id"]
    # truncation is reported and applied
    short = build_lra_task_data(_cfg(listops_root, seq_len=20), info, _ac)
    assert short.extra["truncated_train"] > 0 and "truncating" in capsys.readouterr().out
    assert next(short.train)["input_ids"].shape[1] <= 20


def test_retrieval_trains_two_tower_model_through_the_loop(tmp_path):
    from transnormer.train.loop import train

    _aan_fixture(tmp_path)
    cfg = TrainConfig(task="cls", preset="t2-lra-retrieval-tiny", data=f"lra:retrieval:{tmp_path}", seq_len=64,
                      batch_size=4, max_steps=2, out_dir=str(tmp_path / "run"), progress=False, eval_batches=1,
                      cls_read_kwargs={"provenance": "synthetic-fixture", "name": "aan-fixture"})
    summary = train(cfg)
    assert summary["eval"]["data_provenance"] == "synthetic-fixture"
    assert summary["eval"]["dataset_id"] == "retrieval-aan-fixture (synthetic-fixture), cut to 64"
    ckpt = tmp_path / "run" / "checkpoints"
    cfg_json = json.loads((ckpt / (ckpt / "latest").read_text().strip() / "config.json").read_text())
    assert cfg_json["architectures"] == ["TransNormerDualEncoderForSequenceClassification"]
    out = tmp_path / "eval.json"
    rc = main(["lra", "eval", "retrieval", "--model", str(tmp_path / "run"), "--root", str(tmp_path),
               "--provenance", "synthetic-fixture", "--name", "aan-fixture", "--seq-len", "64", "--out", str(out)])
    rec = json.loads(out.read_text())
    assert rc == 0 and rec["n"] == 8 and rec["data_provenance"] == "synthetic-fixture"
    assert "synthetic-fixture" in out.with_suffix(".md").read_text()


# ------------------------------------------------------------------------------------------- CLI + results
def test_cli_prepare_listops_small(tmp_path, capsys):
    rc = main(["lra", "prepare", "listops", "--out", str(tmp_path), "--n-train", "30", "--n-val", "5",
               "--n-test", "5", "--min-length", "10", "--max-length", "50", "--seed", "2"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["counts"] == {"train": 30, "val": 5, "test": 5}
    assert out["data_provenance"] == "synthetic-fixture" and out["dataset_id"].startswith("listops-fixture")
    assert (tmp_path / "listops-1000" / "basic_train.tsv").is_file()
    assert main(["lra", "prepare", "text", "--out", str(tmp_path)]) == 2
    assert "aclImdb" in capsys.readouterr().err


def test_cli_train_writes_provenance(listops_root, tmp_path, capsys):
    run = tmp_path / "run"
    rc = main(["lra", "train", "listops", "--preset", "t2-lra-listops-tiny", "--root", str(listops_root),
               "--max-steps", "2", "--batch-size", "8", "--lr", "1e-3", "--out", str(run), "--no-progress",
               "--eval-batches", "1"])
    assert rc == 0
    rec = json.loads((run / "lra_result.json").read_text())
    assert rec["data_provenance"] == "synthetic-fixture" and rec["dataset_id"].startswith("listops-fixture")
    assert rec["test"]["data_provenance"] == rec["val"]["data_provenance"] == "synthetic-fixture"
    assert rec["data"]["sha256"] and rec["data"]["seed"] == 5 and rec["data"]["counts"]["train"] == 96
    assert rec["training"]["weight_decay"] == 0.0 and rec["training"]["clip"] == 0.0 and rec["training"]["seed"] == 2222
    assert rec["test"]["n"] == 24 and not rec["comparable_to_published"]
    md = (run / "lra_result.md").read_text()
    assert "synthetic-fixture" in md and rec["dataset_id"] in md and "LRA average" not in md
    capsys.readouterr()
    assert main(["lra", "report", str(run)]) == 0
    table = capsys.readouterr().out
    assert "synthetic-fixture" in table and "LRA average" not in table
    assert main(["lra", "report", str(run), str(run / "lra_result.json")]) == 2  # its rows twice, rc 0
    assert "is given twice" in capsys.readouterr().err
    before = (run / "lra_result.json").read_text()
    assert main(["lra", "eval", "listops", "--model", str(run), "--out", str(run / "lra_result.json")]) == 2
    assert "is the result of an `lra train` run" in capsys.readouterr().err  # it had been replaced
    assert (run / "lra_result.json").read_text() == before
    for stem in ("lra_result", "lra_result.txt"):  # the .md beside the JSON had replaced the run's table
        assert main(["lra", "eval", "listops", "--model", str(run), "--out", str(run / stem)]) == 2
        assert "or the .md written beside it, is the result" in capsys.readouterr().err
    assert (run / "lra_result.md").read_text() == md


def test_cli_train_of_a_diverged_run_writes_no_result(listops_root, tmp_path, capsys, monkeypatch):
    """A run the loop stopped (non-finite loss or gradient) must not be scored from an earlier
    checkpoint and written up as a result under its step count."""
    import transnormer.train.loop as loop

    real = loop.train

    def diverging(cfg):
        summary = real(cfg)  # trains and saves a model, as a run with --save-every would have
        return {**summary, "diverged_at": 2}

    monkeypatch.setattr(loop, "train", diverging)
    run = tmp_path / "run"
    assert main(["lra", "train", "listops", "--preset", "t2-lra-listops-tiny", "--root", str(listops_root),
                 "--max-steps", "2", "--batch-size", "8", "--out", str(run), "--no-progress",
                 "--eval-batches", "1"]) == 1
    assert "the run diverged at step 2" in capsys.readouterr().err
    assert not (run / "lra_result.json").exists()


@pytest.mark.parametrize("epochs,batch,steps", [(1, 8, 6), (4, 64, 3)])
def test_cli_train_epochs_count_optimizer_steps_of_the_global_batch(listops_root, tmp_path, epochs, batch, steps):
    """--epochs 1 with --grad-accum 2: each step takes 2 x 8 of the 96 training examples, so 6 steps
    (12 had read the data twice). 4 epochs of 96 in steps of 2 x 64: 3 steps (steps per epoch had been
    rounded down to 0 first, and the run cut to 1)."""
    run = tmp_path / "run"
    assert main(["lra", "train", "listops", "--preset", "t2-lra-listops-tiny", "--root", str(listops_root),
                 "--epochs", str(epochs), "--batch-size", str(batch), "--grad-accum", "2", "--lr", "1e-3",
                 "--out", str(run), "--no-progress", "--eval-batches", "1", "--test-batches", "1"]) == 0
    rec = json.loads((run / "lra_result.json").read_text())
    assert rec["training"]["max_steps"] == steps and rec["steps"] == steps


@pytest.mark.slow
def test_cli_train_on_two_processes_scores_the_splits_once_over_the_ranks(listops_root, tmp_path):
    """Each rank scores its share of val and test in the training's process group; rank 0 writes.
    (Every rank had evaluated both whole splits alone and written the same files.)"""
    run = tmp_path / "run"
    run_runs_on_two_ranks(tmp_path, [("cli", ["lra", "train", "listops", "--preset", "t2-lra-listops-tiny", "--root",
                                              str(listops_root), "--max-steps", "2", "--batch-size", "4", "--lr",
                                              "1e-3", "--out", str(run), "--no-progress", "--eval-batches", "1"])])
    rec = json.loads((run / "lra_result.json").read_text())
    assert rec["val"]["n"] == 24 and rec["test"]["n"] == 24
    # --batch-size is the total (as the authors' batches are): each of the 2 processes takes 2
    assert rec["training"]["batch_size"] == 4 and json.loads((run / "train_config.json").read_text())["batch_size"] == 2


@pytest.mark.slow
def test_cli_train_with_synced_batch_norm_on_two_processes_follows_one(listops_root, tmp_path, capsys):
    """Batch norm synced over the processes (lra train's default, the authors' SyncBatchNorm): 2
    processes x 2 examples train as 1 process x 4 (the same losses, under DDP's own gradient
    all-reduces); per process statistics (--no-sync-batch-norm) give others."""
    common = ["lra", "train", "listops", "--preset", "t2-lra-listops-tiny", "--root", str(listops_root),
              "--max-steps", "3", "--batch-size", "4", "--lr", "1e-3", "--no-progress", "--eval-batches", "1",
              "--test-batches", "1"]
    with on_threads(1):  # the one-process run here, on one thread as each rank
        assert main([*common, "--out", str(tmp_path / "one")]) == 0
    run_runs_on_two_ranks(tmp_path, [("cli", [*common, "--out", str(tmp_path / name), *flags])
                                     for name, flags in (("sync", []), ("local", ["--no-sync-batch-norm"]))])

    def losses(name):
        return [r["loss"] for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
                if r.get("kind") == "train"]

    one, sync, local = losses("one"), losses("sync"), losses("local")
    assert len(one) == 3 and sync == pytest.approx(one, rel=0, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(one, local)) > 1e-3
    assert json.loads((tmp_path / "sync" / "lra_result.json").read_text())["training"]["sync_batch_norm"] is True
    # a model without batch norm runs without it (the default), and is refused it when asked
    common[common.index("--max-steps") + 1] = "1"
    srms = ["--set", "norm_type=simple_rms", "--out", str(tmp_path / "srms")]
    assert main([*common, *srms]) == 0
    capsys.readouterr()
    assert main([*common, *srms, "--sync-batch-norm"]) == 2
    assert "needs norm_type 'batch'" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--batch-size", "0"], ["--seq-len", "0"], ["--epochs", "-5"],
                                   ["--grad-accum", "0"], ["--test-batches", "0"], ["--max-steps", "0"]])
def test_cli_train_refuses_values_it_would_have_replaced(listops_root, tmp_path, capsys, flags):
    with pytest.raises(SystemExit) as e:
        main(["lra", "train", "listops", "--root", str(listops_root), "--out", str(tmp_path / "run"), *flags])
    assert e.value.code == 2 and f"argument {flags[0]}: expected" in capsys.readouterr().err


def test_evaluate_lra_refuses_zero_batches(listops_root):
    from transnormer.train.lra_tasks import evaluate_split

    model = build_model("t2-lra-listops-tiny")
    with pytest.raises(ValueError, match="max_batches must be an int >= 1"):
        evaluate_split(model, f"lra:listops:{listops_root}", "test", max_len=64, max_batches=0)


def test_lra_eval_and_report_refuse_what_they_cannot_score(listops_root, tmp_path, capsys):
    """A causal LM loaded as a classifier got a fresh random head and a score; --out X.md had the
    markdown overwrite the JSON; report read an eval's JSON into a KeyError."""
    lm = tmp_path / "lm"
    build_model("t2-lm-tiny", vocab_size=50).save_pretrained(lm)
    assert main(["lra", "eval", "listops", "--model", str(lm), "--root", str(listops_root)]) == 2
    assert "not a sequence classifier" in capsys.readouterr().err
    other = tmp_path / "other"
    build_model("t2-lra-listops-tiny", num_labels=2).save_pretrained(other)
    assert main(["lra", "eval", "listops", "--model", str(other), "--root", str(listops_root)]) == 2
    assert "a model trained on another task" in capsys.readouterr().err
    text = tmp_path / "text"  # 2 classes, bytes: a single tower would score each pair's first document alone
    build_model("t2-lra-text-tiny").save_pretrained(text)
    assert main(["lra", "eval", "retrieval", "--model", str(text), "--root", str(listops_root)]) == 2
    assert "is a single-tower classifier; retrieval needs a two-tower one" in capsys.readouterr().err
    from transnormer.train.lra_tasks import LRAVocab

    LRAVocab("text", 257, 0).save(text)  # as `lra train` records it: Text's sizes had passed for Pathfinder
    assert main(["lra", "eval", "pathfinder", "--model", str(text), "--root", str(listops_root)]) == 2
    assert "was trained on text, not pathfinder" in capsys.readouterr().err
    assert main(["lra", "eval", "listops", "--model", str(other), "--out", str(tmp_path / "e.md")]) == 2
    assert "give the JSON file's name" in capsys.readouterr().err
    (tmp_path / "ev.json").write_text(json.dumps({"kind": "lra-eval", "task": "listops"}))
    assert main(["lra", "report", str(tmp_path / "ev.json")]) == 2
    assert "is not an lra_result.json of `lra train` (kind 'lra-eval'" in capsys.readouterr().err


def test_results_table_naming_rule():
    from transnormer.cli_lra import results_table

    def rec(task, prov, acc):
        return {"task": task, "preset": f"t2-lra-{task}", "data_provenance": prov, "dataset_id": f"{task}-x",
                "test": {"accuracy": acc}}

    partial = results_table([rec("listops", "regenerated", 0.4), rec("pathfinder", "regenerated", 0.7)])
    assert "LRA average" not in partial and "avg over ListOps (regenerated) + Pathfinder (regenerated)" in partial
    five = [rec(t, "official", 0.5) for t in ("listops", "text", "retrieval", "image", "pathfinder")]
    assert "LRA average (five tasks, official data): 50.00" in results_table(five)
    mixed = five[:4] + [rec("pathfinder", "regenerated", 0.5)]
    assert "LRA average" not in results_table(mixed)
    assert "avg" not in results_table(five[:1])
    # Path-X is reported beside the five, not averaged in (it had hidden the official average)
    with_pathx = results_table(five + [rec("pathx", "official", 0.9)])
    assert "t2: LRA average (five tasks, official data): 50.00" in with_pathx and "| Path-X |" in with_pathx
    # a run cut below the task length is not the benchmark, and a full-length one is preferred to it
    cut = [{**r, "dataset_id": r["dataset_id"] + ", cut to 256"} for r in five]
    assert "LRA average" not in results_table(cut)
    # and the average's name says so (§6.3: named after its data; it had read "Retrieval (official)")
    assert "avg over ListOps (official, cut) + Text (official)" in results_table([cut[0], five[1]])
    short = [{**r, "seq_len": 256} for r in five]  # a result written before the ", cut to N" label
    assert "LRA average" not in results_table(short)
    better_but_cut = {**cut[0], "test": {"accuracy": 0.9}}
    assert "LRA average (five tasks, official data): 50.00" in results_table([better_but_cut] + five)
    # a short --seq-len that cut nothing (recorded since "subset" is): the task's data
    uncut = [{**r, "seq_len": 256, "test": {**r["test"], "subset": False}} for r in five]
    assert "LRA average (five tasks, official data): 50.00" in results_table(uncut)
    # a score over a --test-batches subset is a sample: labelled, ranked after the whole split, never the
    # official average (it had been averaged as one)
    sub = [{**r, "test": {"accuracy": 0.9, "n": 4, "n_split": 12, "subset": True}} for r in five]
    table = results_table(sub)
    assert "LRA average" not in table and "| test (subset 4/12) | 90.00 |" in table
    assert "avg over ListOps (official, subset) + Text (official, subset)" in results_table(sub[:2])
    assert "LRA average (five tasks, official data): 50.00" in results_table(sub + five)
    # the split's note (Text's validation is the test split) is carried into the report's rows
    text_val = {**five[1], "val": {"accuracy": 0.5, "note": "validation = test split (official LRA behaviour)"}}
    assert "| val (validation = test split (official LRA behaviour)) | 50.00 |" in results_table([text_val], "val")


def test_report_averages_each_model_alone_and_prefers_official_data():
    from transnormer.cli_lra import results_table

    def rec(task, prov, val, test, preset=None):
        return {"task": task, "preset": preset or f"t2-lra-{task.split('-')[0]}", "data_provenance": prov,
                "dataset_id": task, "val": {"accuracy": val}, "test": {"accuracy": test}}

    five = [rec(t, "official", 0.5, 0.5) for t in ("listops", "text", "retrieval", "image", "pathfinder")]
    # FMNIST (~90%) beat CIFAR (~50%) on validation and replaced it in the official mean
    table = results_table(five + [rec("image-fmnist32", "stand-in", 0.9, 0.9)])
    assert "t2: LRA average (five tasks, official data): 50.00" in table
    # a vanilla ListOps run with a better validation was averaged with T2's other four tasks
    table = results_table(five + [rec("listops", "official", 0.9, 0.9, preset="vanilla-lra-listops")])
    assert "t2: LRA average (five tasks, official data): 50.00" in table and "vanilla: avg" not in table
    # the same preset with other --set overrides is another model (an ablation variant)
    variant = {**rec("listops", "official", 0.9, 0.9), "overrides": {"norm_type": "simple_rms"}}
    table = results_table(five + [variant])
    assert "t2: LRA average (five tasks, official data): 50.00" in table


def test_text_and_retrieval_truncation_is_counted(tmp_path, capsys):
    """Documents are loaded at the task's length and cut to the run's per item, so the cut is counted."""
    _aan_fixture(tmp_path)
    data = build_lra_task_data(_cfg(tmp_path, task="retrieval", seq_len=16), DistInfo(), _ac)
    assert data.extra["truncated_train"] > 0 and "truncating" in capsys.readouterr().out
    batch = next(data.train)
    assert batch["input_ids"].shape[1] <= 16
    # the label names the length the run read (it had named the task's 4,000), and a cut run is not
    # comparable to the published numbers even on official data
    from transnormer.train.lra_tasks import comparable_to_published, load_split

    assert load_split("retrieval", tmp_path, "test", 16).dataset_id.endswith("L=4000), cut to 16")
    assert load_split("retrieval", tmp_path, "test", 4000).dataset_id.endswith("L=4000)")
    # below the task length but above every document: nothing is cut, and the label had said so anyway
    whole = load_split("retrieval", tmp_path, "test", 4000)
    longest = max(len(s) for seq in (whole.inputs, whole.inputs_2) for s in seq)
    assert longest < 1000 and load_split("retrieval", tmp_path, "test", 1000).dataset_id.endswith("L=4000)")
    official = {"data_provenance": "official", "dataset_id": "retrieval-aan(bytes, L=4000)", "n": 8, "n_split": 8,
                "subset": False}
    assert comparable_to_published(official)
    assert not comparable_to_published({**official, "dataset_id": official["dataset_id"] + ", cut to 16"})
    assert not comparable_to_published({**official, "n": 4, "subset": True})  # --test-batches: a sample
    assert not comparable_to_published({**official, "data_provenance": "regenerated"})


def _imdb_sorted(root, n=12):
    """aclImdb with all negative reviews before the positive ones, as the real files are read."""
    for part in ("train", "test"):
        for cls in ("neg", "pos"):
            d = root / "aclImdb" / part / cls
            d.mkdir(parents=True)
            for i in range(n):
                (d / f"{i}_{2 if cls == 'neg' else 8}.txt").write_text(f"{cls} review {i} " * 3)
    return root


def test_lra_results_cover_whole_splits_and_say_what_val_is(tmp_path):
    """The reported validation accuracy read the first --eval-batches batches in file order (all
    negative reviews: 'majority 80%' on a 50/50 split); now the whole split, labelled as the test
    split where it is one, and a limited evaluation takes a spread subset."""
    from transnormer.train.evaluate import evaluate_classifier

    _imdb_sorted(tmp_path)
    run = tmp_path / "run"
    assert main(["lra", "train", "text", "--preset", "t2-lra-text-tiny", "--root", str(tmp_path), "--seq-len", "32",
                 "--max-steps", "1", "--batch-size", "2", "--eval-batches", "2", "--out", str(run),
                 "--no-progress"]) == 0
    rec = json.loads((run / "lra_result.json").read_text())
    assert rec["val"]["n"] == 24 and rec["val"]["majority_accuracy"] == 0.5
    assert rec["val"]["note"].startswith("validation = test split")
    assert "val (validation = test split" in (run / "lra_result.md").read_text()

    class Labels(torch.nn.Module):  # predicts nothing useful; the subset's labels are what is read
        def forward(self, input_ids, attention_mask=None, **kw):
            return type("O", (), {"logits": torch.zeros(input_ids.shape[0], 2)})()

    from transnormer.train.lra_tasks import load_split
    ds = load_split("text", str(tmp_path), "val", 32, {})
    res = evaluate_classifier(Labels(), ds, ds.collate_fn(), DistInfo(), 4, 2, _ac, majority_class=0)
    assert res["n"] == 8 and 0 < res["majority_accuracy"] < 1  # both classes in the subset


def test_lra_eval_defaults_to_the_runs_data_settings(listops_root, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["lra", "train", "listops", "--preset", "t2-lra-listops-tiny", "--root", str(listops_root),
                 "--seq-len", "16", "--max-steps", "2", "--batch-size", "8", "--out", str(run), "--no-progress",
                 "--provenance", "stand-in", "--name", "toy"]) == 0
    rec = json.loads((run / "lra_result.json").read_text())
    capsys.readouterr()
    out = tmp_path / "eval.json"
    assert main(["lra", "eval", "listops", "--model", str(run), "--root", str(listops_root), "--out", str(out)]) == 0
    ev = json.loads(out.read_text())
    assert ev["seq_len"] == 16 and ev["accuracy"] == rec["test"]["accuracy"]
    assert ev["data_provenance"] == "stand-in" and ev["dataset_id"] == rec["dataset_id"]
    assert not ev["comparable_to_published"] and ev["trained_on"]["data_provenance"] == "stand-in"
    # without --root: the folder the run read; a later run in the same folder does not change what
    # an earlier run's checkpoint was trained with
    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert main(["lra", "train", "listops", "--preset", "t2-lra-listops-tiny", "--root", str(listops_root),
                 "--seq-len", "48", "--max-steps", "1", "--batch-size", "8", "--out", str(run), "--no-progress"]) == 0
    old = next((run / "checkpoints").glob("earlier-run-*")) / ckpt.name
    assert main(["lra", "eval", "listops", "--model", str(old), "--out", str(out)]) == 0
    again = json.loads(out.read_text())
    assert again["seq_len"] == 16 and again["accuracy"] == rec["test"]["accuracy"]
    assert again["data_provenance"] == "stand-in"


@pytest.mark.filterwarnings("ignore:dtype bf16 on a CPU without")  # (a tiny model: slow bf16 products do not matter)
def test_lra_eval_finds_a_relative_root_from_elsewhere_and_keeps_the_runs_precision(listops_root, tmp_path,
                                                                                    capsys, monkeypatch):
    """The run saved its --root as given: `lra eval` from another folder failed ("root: directory not
    found") or read that folder's data/; it evaluated a bf16 run in fp32 and recorded neither; the
    training split's record (SHA-256, size, cut sequences) was written nowhere."""
    import shutil

    shutil.copytree(listops_root, tmp_path / "lo")
    monkeypatch.chdir(tmp_path)
    assert main(["lra", "train", "listops", "--preset", "t2-lra-listops-tiny", "--root", "lo", "--seq-len", "16",
                 "--max-steps", "2", "--batch-size", "8", "--out", "run", "--no-progress", "--dtype", "bf16"]) == 0
    rec = json.loads((tmp_path / "run" / "lra_result.json").read_text())
    assert rec["training"]["dtype"] == "bf16"
    assert rec["train_data"]["n_train"] > 0 and rec["train_data"]["truncated"] > 0 and rec["train_data"]["sha256"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["lra", "eval", "listops", "--model", str(tmp_path / "run"), "--out", "ev.json"]) == 0
    ev = json.loads((elsewhere / "ev.json").read_text())
    assert ev["dtype"] == "bf16" and ev["accuracy"] == rec["test"]["accuracy"]
    assert ev["loss"] == pytest.approx(rec["test"]["loss"], rel=1e-5)  # (its own batches)


def test_report_does_not_choose_among_runs_validated_on_test():
    # Text validates on its test split: the best of several runs "by validation" was the best on test
    from transnormer.cli_lra import results_table

    def rec(task, acc, on_test):
        return {"task": task, "preset": "t2-lra-x", "data_provenance": "stand-in", "dataset_id": task,
                "val": {"accuracy": acc, **({"eval_split": "test"} if on_test else {})}, "test": {"accuracy": acc}}

    table = results_table([rec("listops", 0.4, False), rec("text", 0.60, True), rec("text", 0.64, True)])
    assert table.strip().endswith(f"{100 * (0.4 + 0.60) / 2:.2f}")  # the first Text run, not the best on test


def _imdb_fixture(root, n=6):
    for part in ("train", "test"):
        for cls in ("pos", "neg"):
            d = root / "aclImdb" / part / cls
            d.mkdir(parents=True)
            for i in range(n // 2):
                (d / f"{i}_{8 if cls == 'pos' else 2}.txt").write_text(f"{part} {cls} review number {i}")


def test_texts_official_validation_is_recorded_as_the_test_split_it_reads(tmp_path):
    # its records said "val" (the loader's name), so report's guard against choosing on test never fired
    from transnormer.cli_lra import results_table
    from transnormer.train.lra_tasks import evaluate_split

    _imdb_fixture(tmp_path)
    model = build_model("t2-lra-text-tiny").eval()
    spec = f"lra:text:{tmp_path}"
    official, _ = evaluate_split(model, spec, "val", max_len=32)
    assert official["eval_split"] == "test" and official["note"].startswith("validation = test split")
    carved, _ = evaluate_split(model, spec, "val", max_len=32, options={"val_from": "train", "val_fraction": 0.5})
    assert carved["eval_split"] == "val"

    def rec(task, acc, val):
        return {"task": task, "preset": "t2-lra-x", "data_provenance": "stand-in", "dataset_id": task,
                "val": {**val, "accuracy": acc}, "test": {"accuracy": acc}}

    for val in (official, {"note": official["note"]}):  # today's records, and earlier ones by their note
        table = results_table([rec("listops", 0.4, {}), rec("text", 0.60, val), rec("text", 0.64, val)])
        assert table.strip().endswith(f"{100 * (0.4 + 0.60) / 2:.2f}")


def test_text_and_pathfinder_options_are_checked_by_name(tmp_path):
    from transnormer.data.lra import load_lra

    _imdb_fixture(tmp_path)
    with pytest.raises(ValueError, match="val_seed"):
        load_lra("text", tmp_path, "val", val_from="train", val_seed=-1)
    with pytest.raises(ValueError, match="val_fraction=0.95 carves 6 of the 6 training reviews"):
        load_lra("text", tmp_path, "train", val_from="train", val_fraction=0.95)
    assert len(load_lra("text", tmp_path, "train", val_from="train", val_fraction=0.5)) == 3
    with pytest.raises(ValueError, match="difficulty must be one of .* got 'medium'"):
        load_lra("pathfinder", tmp_path, "test", difficulty="medium")
    with pytest.raises(TypeError, match="split_seed must be an int, got str"):
        load_lra("pathfinder", tmp_path, "test", split_seed="a", split_mode="random")


def test_official_listops_and_pathfinder_results_record_their_files_digests(listops_root, tmp_path):
    # lra.md §6.4: only our regenerated sets (through their sidecar) had carried SHA-256s
    import shutil

    from transnormer.data.lra._common import sha256_file
    from transnormer.train.lra_tasks import load_split, provenance_record

    official = tmp_path / "lo" / "listops-1000"
    official.mkdir(parents=True)
    for f in ("basic_train.tsv", "basic_val.tsv", "basic_test.tsv"):
        shutil.copy(listops_root / "listops-1000" / f, official / f)
    rec = provenance_record(load_split("listops", str(tmp_path / "lo"), "val", 64, {}))
    assert rec["data_provenance"] == "official"
    assert rec["sha256"] == {"basic_val.tsv": sha256_file(official / "basic_val.tsv")}
    pf = tmp_path / "pf"
    prepare("pathfinder", pf, seed=0, n_images=20)
    for side in pf.rglob("generation.json"):
        side.unlink()  # the official layout: no sidecar
    rec = provenance_record(load_split("pathfinder", str(pf), "test", None, {}))
    assert rec["data_provenance"] == "official"
    metas = sorted(pf.rglob("metadata/*.npy"))
    assert metas and rec["sha256"] == {p.name: sha256_file(p) for p in metas}


def test_a_generated_listops_file_changed_after_generation_is_refused(listops_root, tmp_path):
    import shutil

    from transnormer.train.lra_tasks import load_split

    root = tmp_path / "lo"
    shutil.copytree(listops_root, root)
    val = root / "listops-1000" / "basic_val.tsv"
    lines = val.read_text().splitlines(keepends=True)
    val.write_text("".join(lines[:-1]))  # one row dropped
    with pytest.raises(ValueError, match="SHA-256"):
        load_split("listops", str(root), "val", 64, {})
    val.write_text(lines[0])  # header only
    with pytest.raises(ValueError, match="no rows after the header"):
        load_split("listops", str(root), "val", 64, {})
    assert len(load_split("listops", str(root), "test", 64, {})) == 24  # the untouched files still load


def test_no_truncate_applies_to_lra_data(listops_root):
    with pytest.raises(ValueError, match="no_truncate"):
        build_lra_task_data(_cfg(listops_root, seq_len=16, no_truncate=True), DistInfo(), _ac)


def test_report_counts_the_fmnist_stand_in_in_images_place_and_selects_on_validation():
    from transnormer.cli_lra import results_table

    def rec(task, val, test):
        return {"task": task, "preset": "p", "data_provenance": "stand-in", "dataset_id": task,
                "val": {"accuracy": val}, "test": {"accuracy": test}}

    zero = results_table([rec("listops", 0.0, 0.9), rec("listops", 0.5, 0.6), rec("text", 0.5, 0.5)])
    assert zero.strip().endswith(f"{100 * (0.6 + 0.5) / 2:.2f}")  # a validation of 0.0 is a score, not a gap
    table = results_table([rec("image", 0.6, 0.3), rec("image-fmnist32", 0.5, 0.9), rec("listops", 0.4, 0.5)])
    assert "(2 tasks;" in table and "avg over Image (stand-in) + ListOps (stand-in)" in table
    assert table.strip().endswith(f"{100 * (0.3 + 0.5) / 2:.2f}")  # Image by its validation: the 0.3-test run


def test_prepare_and_the_loaders_look_for_fmnist_in_the_same_folder(tmp_path, monkeypatch):
    from transnormer.data.lra.image import default_fmnist_dir

    monkeypatch.delenv("TRANSNORMER_FMNIST_DIR", raising=False)
    wd = tmp_path / "wd"
    wd.mkdir()
    (tmp_path / "shared" / "data" / "lra" / "fashion-mnist").mkdir(parents=True)
    monkeypatch.chdir(wd)
    assert default_fmnist_dir().resolve() == (tmp_path / "shared" / "data" / "lra" / "fashion-mnist").resolve()
    assert default_root("image-fmnist32") == str(default_fmnist_dir())


def test_lra_cli_refuses_what_it_would_ignore_or_overwrite(listops_root, tmp_path, capsys):
    # official-looking files (no generation.json of ours) had been replaced by a fixture, rc 0
    official = tmp_path / "official" / "listops-1000"
    official.mkdir(parents=True)
    (official / "basic_train.tsv").write_text("Source\tTarget\n( MAX 1 2 )\t2\n")
    fixture = ["--n-train", "4", "--n-val", "4", "--n-test", "4", "--min-length", "5", "--max-length", "40"]
    assert main(["lra", "prepare", "listops", "--out", str(tmp_path / "official"), *fixture]) == 2
    assert "without a generation.json" in capsys.readouterr().err
    assert (official / "basic_train.tsv").read_text().startswith("Source\tTarget\n( MAX 1 2 )")
    assert main(["lra", "prepare", "listops", "--out", str(tmp_path / "new"), *fixture]) == 0
    assert main(["lra", "prepare", "listops", "--out", str(tmp_path / "new"), *fixture[:-4], "--min-length", "6",
                 "--max-length", "40"]) == 0  # a generation of ours is made again from its sidecar: replaced
    new = tmp_path / "new" / "listops-1000"
    assert not (new / ".generating").exists()
    (new / "generation.json").unlink()  # a kill before the sidecar: the marker says the files are ours
    (new / ".generating").write_text("")
    from transnormer.data.lra import load_lra

    with pytest.raises(ValueError, match="an interrupted generation"):  # it had loaded as the official files
        load_lra("listops", tmp_path / "new", "train")
    assert main(["lra", "prepare", "listops", "--out", str(tmp_path / "new"), *fixture]) == 0
    assert len(load_lra("listops", tmp_path / "new", "train")) == 4
    assert (new / "generation.json").is_file() and not (new / ".generating").exists()
    capsys.readouterr()
    assert main(["lra", "prepare", "listops", "--out", str(tmp_path / "z"), "--n-train", "0"]) == 2
    assert "n_train must be" in capsys.readouterr().err
    assert main(["lra", "prepare", "listops", "--out", str(tmp_path / "z"), "--n-images", "5"]) == 2
    assert "--n-images does not apply to listops" in capsys.readouterr().err
    common = ["lra", "train", "listops", "--root", str(listops_root), "--preset", "t2-lra-listops-tiny",
              "--out", str(tmp_path / "run")]
    assert main([*common, "--epochs", "1", "--max-steps", "1"]) == 2  # --epochs had been ignored
    assert "give it or --max-steps / --budget, not both" in capsys.readouterr().err
