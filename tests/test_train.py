"""Training engine: DDP parity, exact resume, checkpoint integrity, clear data errors."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transnormer.train import CheckpointError, TrainConfig, latest_valid_checkpoint, train, verify_checkpoint
from transnormer.train.metrics import read_metrics

WORDS = "the of a linear attention model norm block chunk state token layer kernel value query key".split()


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for split, n in (("train", 600), ("valid", 60), ("test", 60)):
        docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) + "." for _ in range(n)]
        (root / f"{split}.txt").write_text("\n\n".join(docs))
    return root


def cfg_for(corpus_dir, tmp_path, **kw):
    base = dict(preset="t2-lm-tiny", data=str(corpus_dir), vocab_size=300, seq_len=32, batch_size=4, max_steps=6,
                lr=3e-3, warmup=2, eval_batches=2, out_dir=str(tmp_path / "run"), progress=False,
                cache_dir=str(tmp_path.parent / "cache"), overrides={"hidden_size": 32, "num_hidden_layers": 2,
                                                                     "num_attention_heads": 2, "block_size": 8,
                                                                     "chunk_size": 8})
    base.update(kw)
    return TrainConfig(**base)


def train_losses(out_dir):
    return [r["loss"] for r in read_metrics(Path(out_dir) / "metrics.jsonl") if r["kind"] == "train"]


def test_kill_and_resume_is_exact(corpus_dir, tmp_path):
    full = cfg_for(corpus_dir, tmp_path / "a", out_dir=str(tmp_path / "full"))
    train(full)
    ref = train_losses(full.out_dir)
    assert len(ref) == 6
    part = cfg_for(corpus_dir, tmp_path / "b", out_dir=str(tmp_path / "part"), save_every=1, stop_after=3)
    assert train(part) == {"stopped_at": 3}
    # a "crash" after step 3's checkpoint: the run resumes at step 3 and repeats nothing
    resumed = cfg_for(corpus_dir, tmp_path / "b", out_dir=str(tmp_path / "part"), save_every=1, resume=True)
    train(resumed)
    got = train_losses(resumed.out_dir)
    assert got == pytest.approx(ref, rel=0, abs=1e-6)


def test_corrupt_checkpoint_falls_back(corpus_dir, tmp_path):
    cfg = cfg_for(corpus_dir, tmp_path, max_steps=4, save_every=2)
    train(cfg)
    root = Path(cfg.out_dir) / "checkpoints"
    newest = root / "step-00000004"
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    with pytest.raises(CheckpointError, match="model.safetensors"):
        verify_checkpoint(newest)
    assert latest_valid_checkpoint(root, log=lambda *a: None).name == "step-00000002"
    verify_checkpoint(root / "step-00000002")
    # and resuming uses the previous checkpoint
    summary = train(cfg_for(corpus_dir, tmp_path, max_steps=4, save_every=2, resume=True))
    assert summary["steps"] == 4


def test_no_temporary_checkpoint_left(corpus_dir, tmp_path):
    cfg = cfg_for(corpus_dir, tmp_path, max_steps=2)
    train(cfg)
    names = [p.name for p in (Path(cfg.out_dir) / "checkpoints").iterdir()]
    assert not [n for n in names if n.startswith(".tmp")]
    assert (Path(cfg.out_dir) / "loss.png").exists() and (Path(cfg.out_dir) / "summary.json").exists()


def test_mlm_and_bf16_run(corpus_dir, tmp_path):
    cfg = cfg_for(corpus_dir, tmp_path, task="mlm", preset="t2-roberta-tiny", max_steps=3, dtype="bf16")
    s = train(cfg)
    assert s["steps"] == 3 and s["eval"]["loss"] > 0


def test_classification_run_and_errors(tmp_path):
    rng = random.Random(1)
    lines = ["sentence\tlabel"] + [f"{' '.join(rng.choice(WORDS) for _ in range(8))}\t{i % 2}" for i in range(64)]
    (tmp_path / "train.tsv").write_text("\n".join(lines) + "\n")
    (tmp_path / "dev.tsv").write_text("\n".join(lines[:17]) + "\n")
    cfg = TrainConfig(task="cls", preset="t2-roberta-tiny", data=str(tmp_path), vocab_size=300, seq_len=16,
                      batch_size=8, max_steps=3, out_dir=str(tmp_path / "run"), progress=False,
                      cache_dir=str(tmp_path / "cache"))
    s = train(cfg)
    assert {"accuracy", "f1", "mcc"} <= set(s["eval"])
    (tmp_path / "dev.tsv").write_text("sentence\tlabel\nsome words here\t7\n")
    with pytest.raises(ValueError, match="7"):
        train(cfg)
    (tmp_path / "dev.tsv").write_text("sentence\tgrade\nsome words\t1\n")
    with pytest.raises(ValueError, match="label"):
        train(cfg)


def test_bad_data_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cfg = TrainConfig(data=str(empty), max_steps=1, out_dir=str(tmp_path / "r"), progress=False,
                      cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="empty"):
        train(cfg)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"hello \xff\xfe world")
    cfg.data = str(bad)
    with pytest.raises(ValueError, match="UTF-8"):
        train(cfg)


def test_sequence_longer_than_model_allows(corpus_dir, tmp_path):
    cfg = cfg_for(corpus_dir, tmp_path, preset="t2-roberta-tiny", task="mlm", seq_len=64, max_steps=1)
    cfg.overrides = {**cfg.overrides, "max_position_embeddings": 32}
    with pytest.raises(ValueError, match="max_position_embeddings"):
        train(cfg)


@pytest.mark.slow
def test_ddp_two_processes_match_one(corpus_dir, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(
        "import sys, json\n"
        "from transnormer.train import TrainConfig, train\n"
        "cfg = TrainConfig(**json.loads(sys.argv[1]))\n"
        "train(cfg)\n"
    )
    import json

    def args(bs, out):
        c = cfg_for(corpus_dir, tmp_path, batch_size=bs, max_steps=5, out_dir=str(tmp_path / out), clip=0.0)
        c.overrides = {**c.overrides, "dropout": 0.0}
        d = {k: getattr(c, k) for k in c.__dataclass_fields__}
        return json.dumps(d)

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(script), args(4, "single")], check=True, env=env, timeout=300)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                    str(script), args(2, "ddp")], check=True, env=env, timeout=300)
    one, two = train_losses(tmp_path / "single"), train_losses(tmp_path / "ddp")
    assert len(one) == len(two) == 5
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-5, (one, two)
    assert torch.tensor(one).isfinite().all()


def test_schedules_and_budgets():
    from transnormer.train import parse_budget
    from transnormer.train.schedule import lr_multiplier

    kw = dict(warmup=10, total_steps=110)
    assert lr_multiplier(4, kind="cosine", **kw) == pytest.approx(0.5)
    assert lr_multiplier(109, kind="cosine", min_lr_ratio=0.1, **kw) == pytest.approx(0.1)
    assert lr_multiplier(39, kind="inverse_sqrt", **kw) == pytest.approx((10 / 40) ** 0.5)
    assert lr_multiplier(0, kind="inverse_sqrt", warmup=8000, total_steps=1, warmup_init_ratio=1e-7 / 5e-4) > 2e-4
    assert lr_multiplier(109, kind="polynomial", **kw) == pytest.approx(0.0)
    assert parse_budget("90s") == ("seconds", 90) and parse_budget("5min") == ("seconds", 300)
    assert parse_budget("200k") == ("tokens", 200_000) and parse_budget("2M") == ("tokens", 2_000_000)
    with pytest.raises(ValueError, match="budget"):
        parse_budget("soon")
    with pytest.raises(ValueError, match="schedule"):
        lr_multiplier(0, kind="linear", warmup=1, total_steps=2)
