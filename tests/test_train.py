"""Training engine: DDP parity, exact resume, checkpoint integrity, clear data errors."""

import contextlib
import json
import os
import random
import re
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from conftest import CORPUS_WORDS, on_threads, run_runs_on_two_ranks, run_two_ranks, write_small_corpus
from transnormer.train import CheckpointError, TrainConfig, latest_valid_checkpoint, train, verify_checkpoint
from transnormer.train.distributed import DistInfo
from transnormer.train.loop import build_model_for, special_token_ids
from transnormer.train.metrics import read_metrics
from transnormer.train.tasks import build_task_data

WORDS = CORPUS_WORDS  # (the cls tests' sentences too)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_small_corpus(root, splits=(("train", 600), ("valid", 60), ("test", 60)))
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


@pytest.mark.parametrize("task", ["clm", "mlm"])  # mlm: whole-sentence blocks, masked per step
def test_kill_and_resume_is_exact(corpus_dir, tmp_path, task):
    kw = {"task": task, "preset": "t2-lm-tiny" if task == "clm" else "t2-roberta-tiny"}
    full = cfg_for(corpus_dir, tmp_path / "a", out_dir=str(tmp_path / "full"), **kw)
    train(full)
    ref = train_losses(full.out_dir)
    assert len(ref) == 6
    part = cfg_for(corpus_dir, tmp_path / "b", out_dir=str(tmp_path / "part"), save_every=1, stop_after=3, **kw)
    assert train(part) == {"stopped_at": 3}
    # a "crash" after step 3's checkpoint, in the middle of writing a metrics record: the run resumes
    # at step 3, drops the torn record and repeats nothing
    with open(Path(part.out_dir) / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 4, "lo')
    resumed = cfg_for(corpus_dir, tmp_path / "b", out_dir=str(tmp_path / "part"), save_every=1, resume=True, **kw)
    train(resumed)
    got = train_losses(resumed.out_dir)
    assert got == pytest.approx(ref, rel=0, abs=1e-6)


def test_a_flash_run_saved_before_gamma_beta_left_the_decay_group_resumes(corpus_dir, tmp_path, monkeypatch, capsys):
    # its optimizer's groups hold other numbers of parameters: load_state_dict had refused them
    import transnormer.train.loop as loop

    new_groups = loop.param_groups
    kw = {"preset": "flash-lm-tiny", "overrides": {"hidden_size": 32, "num_hidden_layers": 2}, "weight_decay": 0.1,
          "max_steps": 4}
    monkeypatch.setattr(loop, "param_groups", lambda *a, **k: new_groups(*a, **{**k, "by_name": False}))
    part = cfg_for(corpus_dir, tmp_path, out_dir=str(tmp_path / "part"), save_every=2, stop_after=2, **kw)
    assert train(part) == {"stopped_at": 2}
    monkeypatch.setattr(loop, "param_groups", new_groups)
    assert train(replace(part, stop_after=None, resume=True))["steps"] == 4
    assert "decays GAU/FLASH's gamma and beta, as it did when it started" in capsys.readouterr().out


def test_a_fine_tune_resumes_after_its_init_from_run_moved(corpus_dir, tmp_path):
    """Resuming rebuilt the model and tokenizer from init_from, which the checkpoint already holds:
    with the pretrained run moved away the resume failed."""
    train(cfg_for(corpus_dir, tmp_path, out_dir=str(tmp_path / "pre"), max_steps=2))
    kw = {"init_from": str(tmp_path / "pre"), "overrides": {}, "max_steps": 4}
    full = cfg_for(corpus_dir, tmp_path, out_dir=str(tmp_path / "full"), **kw)
    train(full)
    part = cfg_for(corpus_dir, tmp_path, out_dir=str(tmp_path / "part"), save_every=2, stop_after=2, **kw)
    assert train(part) == {"stopped_at": 2}
    (tmp_path / "pre").rename(tmp_path / "pre-moved")
    assert train(replace(part, stop_after=None, resume=True))["steps"] == 4
    assert train_losses(part.out_dir) == pytest.approx(train_losses(full.out_dir), rel=0, abs=1e-6)


def test_param_groups_decay_matrices_or_everything():
    from transnormer.presets import build_model
    from transnormer.train.loop import param_groups

    model = build_model("t2-lm-tiny", vocab_size=50)
    n = sum(1 for p in model.parameters() if p.requires_grad)
    decay, no_decay = param_groups(model, 0.01)
    assert {p.dim() for p in no_decay["params"]} == {1} and min(p.dim() for p in decay["params"]) == 2
    assert len(decay["params"]) + len(no_decay["params"]) == n
    decay, no_decay = param_groups(model, 0.01, decay_all=True)  # fairseq's Adam: every parameter
    assert len(decay["params"]) == n and not no_decay["params"]
    # GAU/FLASH's per-head γ (a gain) and β (a bias) are 2-D: they had been decayed, against the docs
    for preset in ("flash-lm-tiny", "flash-quad-lm-tiny"):
        model = build_model(preset, vocab_size=50)
        names = {id(p): k for k, p in model.named_parameters()}
        decay, no_decay = param_groups(model, 0.01)
        kept = {names[id(p)].rsplit(".", 1)[-1] for p in no_decay["params"] if p.dim() >= 2}
        assert kept == {"gamma", "beta"}
        assert all(names[id(p)].endswith(".weight") for p in decay["params"])


def test_the_kernel_build_is_not_training_time(corpus_dir, tmp_path, monkeypatch):
    """With an empty kernel cache the first step had built the CPU kernels (15-20 s) on the
    training clock, eating a time budget: make demo's first model lost a fifth of its 90 s."""
    import time

    import transnormer.train.loop as loop

    calls = []
    monkeypatch.setattr(loop, "build_cpu_kernels", lambda: calls.append(time.sleep(2.0)) or True)
    summary = train(cfg_for(corpus_dir, tmp_path, max_steps=2))
    assert len(calls) == 1 and summary["elapsed_s"] < 2.0


def test_read_metrics_drops_only_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')  # damage before the end is not a torn write
    with pytest.raises(ValueError, match="line 2 is not a JSON record"):
        read_metrics(path)


@pytest.mark.parametrize("kw,match", [({"eval_stride": 0}, "eval_stride must be an int in"),
                                      ({"eval_stride": 33}, "eval_stride must be an int in"),
                                      ({"eval_stride": 8, "task": "mlm"}, "eval_stride applies to task 'clm' only"),
                                      ({"mlm_packing": "complete"}, r"mlm_packing \(--mlm-packing\) applies to task 'mlm' only"),
                                      ({"mlm_packing": "lines", "task": "mlm"}, r"mlm_packing \(--mlm-packing\) must be one of")])
def test_eval_stride_is_checked_before_training(corpus_dir, tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        cfg_for(corpus_dir, tmp_path, **kw).check()


@pytest.mark.parametrize("task", ["clm", "mlm"])
def test_a_train_split_too_small_fails_before_the_model_is_built(corpus_dir, tmp_path, monkeypatch, task):
    """The training windows are made at first use (evaluating needs none), and the loop asks for
    them before building the model: a too-small split still fails at once, with the clear error."""
    from transnormer.train import loop

    built = []
    monkeypatch.setattr(loop, "build_model_for", lambda *a, **k: built.append(1))
    kw = {"mlm_packing": "contiguous", "preset": "t2-roberta-tiny"} if task == "mlm" else {}
    with pytest.raises(ValueError, match="fewer than batch_size\\*world_size=100000"):
        train(cfg_for(corpus_dir, tmp_path, task=task, batch_size=100_000, **kw))
    assert not built


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
    # the test split is its own file: evaluated when labelled, refused when not (never the dev file instead)
    data = build_task_data(cfg, DistInfo(), lambda: contextlib.nullcontext())
    model = build_model_for(cfg, data.tokenizer.vocab_size, data.num_labels, special_token_ids(data.tokenizer))
    (tmp_path / "test.tsv").write_text("\n".join(lines[:6]) + "\n")
    data = build_task_data(cfg, DistInfo(), lambda: contextlib.nullcontext())
    assert data.evaluate(model, "test")["n"] == 5 and data.evaluate(model, "valid")["n"] == 16
    (tmp_path / "test.tsv").write_text("index\tsentence\n0\tsome words\n")
    data = build_task_data(cfg, DistInfo(), lambda: contextlib.nullcontext())
    with pytest.raises(ValueError, match="'test'.*cannot be evaluated"):
        data.evaluate(model, "test")
    (tmp_path / "test.tsv").unlink()
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
    """2 processes x batch 2 train as 1 process x batch 4, for the causal LM and the MLM. MLM too:
    its masks are keyed by each row's place in the global batch and its loss weighs micro-batches
    by their masked tokens, so 2x2 matches 1x4 (it had differed by 1e-2)."""
    def cfg(task, bs, out):
        c = cfg_for(corpus_dir, tmp_path, batch_size=bs, max_steps=5, out_dir=str(tmp_path / out), clip=0.0,
                    task=task, preset="t2-lm-tiny" if task == "clm" else "t2-roberta-tiny")
        c.overrides = {**c.overrides, "dropout": 0.0, "attention_dropout": 0.0}
        return c

    tasks = ("clm", "mlm")
    with on_threads(1):  # the one-process references here, on one thread as each rank
        for task in tasks:
            train(cfg(task, 4, f"single-{task}"))
    run_runs_on_two_ranks(tmp_path, [("train", cfg(task, 2, f"ddp-{task}")) for task in tasks])
    for task in tasks:
        one, two = train_losses(tmp_path / f"single-{task}"), train_losses(tmp_path / f"ddp-{task}")
        assert len(one) == len(two) == 5, task
        assert max(abs(a - b) for a, b in zip(one, two)) < 1e-5, (task, one, two)
        assert torch.tensor(one).isfinite().all()


def test_cleanup_leaves_a_process_group_it_did_not_create(tmp_path, monkeypatch):
    """compare and lra train set the group up once around their runs: each run's cleanup must not
    tear it down (a new group against the same torchrun store had failed to connect)."""
    import torch.distributed as dist

    from transnormer.train.distributed import cleanup, setup_distributed

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun, the group already there
        info = setup_distributed("cpu")
        assert info.enabled and not info.owns_group
        cleanup(info)
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_compare_under_torchrun_keeps_one_process_group(corpus_dir, tmp_path):
    script = tmp_path / "run.py"
    script.write_text("import sys\nfrom transnormer.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    c = cfg_for(corpus_dir, tmp_path)
    argv = ["compare", "--presets", "t2-lm-tiny,vanilla-lm-tiny", "--data", c.data, "--vocab-size", "300",
            "--seq-len", "32", "--batch-size", "2", "--max-steps", "2", "--eval-batches", "1", "--no-progress",
            "--cache-dir", c.cache_dir, "--out", str(tmp_path / "cmp"), "--set", "hidden_size=32",
            "--set", "num_hidden_layers=2", "--set", "num_attention_heads=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                    str(script), *argv], check=True, env=env, timeout=300)
    table = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "t2-lm-tiny" in table and "vanilla-lm-tiny" in table


@pytest.mark.slow
def test_fsdp_two_processes_train_as_one_and_resume_exactly(corpus_dir, tmp_path):
    """FSDP2 on CPU (gloo): 2 processes x batch 2 follow 1 process x batch 4, and a run stopped at
    step 3 resumes to the same losses. (The optimizer had been made before fully_shard replaced
    the parameters: it stepped parameters without gradients and the weights never changed.) A
    one-process checkpoint (its optimizer state numbered, not named) resumes sharded on two (it
    had raised a KeyError)."""
    def cfg(bs, out, **kw):
        c = cfg_for(corpus_dir, tmp_path, batch_size=bs, max_steps=5, out_dir=str(tmp_path / out), clip=1.0, **kw)
        c.overrides = {**c.overrides, "dropout": 0.0, "attention_dropout": 0.0}
        return c

    with on_threads(1):  # the one-process runs here, on one thread as each rank
        train(cfg(4, "single"))
        train(cfg(4, "mixed", strategy="fsdp", save_every=1, stop_after=3))
    # each resume in a later launch than the run it resumes: what carries over is what was saved
    run_runs_on_two_ranks(tmp_path, [("train", cfg(2, "fsdp", strategy="fsdp")),
                                     ("train", cfg(2, "part", strategy="fsdp", save_every=1, stop_after=3))])
    assert len(train_losses(tmp_path / "part")) == 3
    run_runs_on_two_ranks(tmp_path, [("train", cfg(2, "part", strategy="fsdp", save_every=1, resume=True)),
                                     ("train", cfg(2, "mixed", strategy="fsdp", save_every=1, resume=True))])
    one, two, resumed, mixed = (train_losses(tmp_path / d) for d in ("single", "fsdp", "part", "mixed"))
    assert len(one) == len(two) == len(resumed) == len(mixed) == 5
    assert one[-1] < one[0] - 0.05  # it learns
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-5, (one, two)
    assert resumed == pytest.approx(two, rel=0, abs=1e-6)  # tighter: the same two-process run, resumed
    assert mixed == pytest.approx(one, rel=0, abs=1e-5)
    from transnormer.cli import resolve_model_dir
    from transnormer.models import TransNormerForCausalLM

    # the checkpoint holds the whole model, gathered from the shards
    whole = TransNormerForCausalLM.from_pretrained(resolve_model_dir(tmp_path / "single"))
    gathered = TransNormerForCausalLM.from_pretrained(resolve_model_dir(tmp_path / "fsdp"))
    for (name, a), b in zip(whole.state_dict().items(), gathered.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_fsdp_evaluation_with_uneven_shards_neither_hangs_nor_crashes(tmp_path):
    """An FSDP model all-gathers its weights in every forward: a rank with fewer evaluation batches
    had gone on to the results' all-reduce while the other was still in a forward (a gloo size
    mismatch for classification, a hang for the LM). Each kind of evaluation, 3 batches against 2."""
    script = tmp_path / "run.py"
    script.write_text(
        "import contextlib, torch\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "from transnormer.presets import build_model\n"
        "from transnormer.train.distributed import setup_distributed, cleanup\n"
        "from transnormer.train.evaluate import evaluate_classifier\n"
        "from transnormer.train.tasks import _eval_lm\n"
        "info = setup_distributed('cpu')\n"
        "torch.manual_seed(0)\n"
        "kw = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, block_size=4,\n"
        "          chunk_size=4)\n"
        "lm, cls = build_model('t2-lm-tiny', **kw), build_model('t2-roberta-tiny', task='cls', num_labels=2, **kw)\n"
        "for m in (lm, cls):\n"
        "    for block in m.model.layers:\n"
        "        fully_shard(block)\n"
        "    fully_shard(m)\n"
        "ids = torch.randint(1, 40, (2, 8))\n"
        "batches = [{'input_ids': ids, 'labels': ids}] * (3 - info.rank)\n"
        "res = _eval_lm(lm, iter(batches), info, None, contextlib.nullcontext, shift=True)\n"
        "assert res['eval_tokens'] == 5 * 2 * 7, res\n"
        "items = [{'input_ids': torch.randint(1, 40, (6,)), 'label': i % 2} for i in range(9)]\n"
        "def collate(rows):\n"
        "    return {'input_ids': torch.stack([r['input_ids'] for r in rows]),\n"
        "            'attention_mask': torch.ones(len(rows), 6, dtype=torch.long),\n"
        "            'labels': torch.tensor([r['label'] for r in rows])}\n"
        "assert evaluate_classifier(cls, items, collate, info, 2, None, contextlib.nullcontext)['n'] == 9\n"
        "class Split(list):\n"
        "    num_classes = 2\n"
        "assert evaluate_classifier(cls, Split(items), collate, info, 2, None, contextlib.nullcontext)['n'] == 9\n"
        "cleanup(info)\n"
    )
    run_two_ranks([str(script)], timeout=120)


@pytest.mark.slow
def test_ddp_ranks_draw_their_own_dropout_masks(corpus_dir, tmp_path):
    """Every rank had seeded the same stream, so the replicas' dropout masks were the same ones: two
    ranks of batch B were not one process of 2B. The weights still start the same on every rank."""
    import json

    def cfg(bs, out, **kw):
        c = cfg_for(corpus_dir, tmp_path, batch_size=bs, out_dir=str(tmp_path / out), **kw)
        c.overrides = {**c.overrides, "dropout": 0.1, "attention_dropout": 0.0}
        return {k: getattr(c, k) for k in c.__dataclass_fields__}

    with on_threads(1):  # stopped after step 1 in one process; resumed below on two
        train(TrainConfig(**cfg(4, "one", max_steps=3, save_every=1, stop_after=1)))
    script = tmp_path / "run.py"
    script.write_text(
        "import hashlib, json, os, sys\n"
        "import torch.nn.functional as F\n"
        "from transnormer.train import TrainConfig, train\n"
        "from transnormer.train.distributed import cleanup, setup_distributed\n"
        "orig, seen = F.dropout, []\n"
        "def rec(x, p=0.5, training=True, inplace=False):\n"
        "    y = orig(x, p, training, inplace)\n"
        "    if training and p > 0:\n"
        "        seen[-1].append(hashlib.sha256((y == 0).numpy().tobytes()).hexdigest())\n"
        "    return y\n"
        "F.dropout = rec\n"
        "info = setup_distributed('cpu')\n"
        "for c in json.loads(sys.argv[1]):\n"
        "    seen.append([])\n"
        "    train(TrainConfig(**c))\n"
        "cleanup(info)\n"
        "out = os.path.join(os.path.dirname(sys.argv[0]), f\"masks{os.environ['RANK']}.json\")\n"
        "open(out, 'w').write(json.dumps([s[:3] for s in seen]))\n"
    )
    # a fresh run; then the one-process run resumed on two processes (the same global batch): rank
    # 0 takes the saved state, and the other ranks still a stream of their own
    runs = [cfg(2, "run", max_steps=1), cfg(2, "one", max_steps=3, save_every=1, resume=True)]
    run_two_ranks([str(script), json.dumps(runs)])
    r0, r1 = (json.loads((tmp_path / f"masks{r}.json").read_text()) for r in (0, 1))
    for m0, m1 in zip(r0, r1, strict=True):
        assert len(m0) == len(m1) == 3 and not set(m0) & set(m1)
    assert len(train_losses(tmp_path / "one")) == 3  # step 1 here, steps 2 and 3 resumed there


@pytest.mark.slow
def test_ddp_time_budget_stops_all_ranks_together(corpus_dir, tmp_path):
    """Each rank had decided a time budget, timed evaluations and the budget-fitted schedule from
    its own clock: one rank went into an evaluation's all-reduce while the other trained (a hang,
    4 runs in 5), and their learning rates drifted apart. Now one clock is shared."""
    import json

    script = tmp_path / "run.py"
    script.write_text(
        "import sys, json, os, torch\n"
        "from transnormer.train import TrainConfig, train\n"
        "from transnormer.train.distributed import unwrap\n"
        "cfg = TrainConfig(**json.loads(sys.argv[1]))\n"
        "s = train(cfg)\n"
        "open(sys.argv[2] + os.environ['RANK'], 'w').write(json.dumps(s['steps']))\n"
    )
    c = cfg_for(corpus_dir, tmp_path, batch_size=2, max_steps=None, budget="4s", eval_every_s=1.0, eval_batches=1,
                warmup=1, out_dir=str(tmp_path / "ddp"))
    d = json.dumps({k: getattr(c, k) for k in c.__dataclass_fields__})
    run_two_ranks([str(script), d, str(tmp_path / "steps")], timeout=240)
    steps = [json.loads((tmp_path / f"steps{r}").read_text()) for r in (0, 1)]
    assert steps[0] == steps[1] > 3
    evals = [r for r in read_metrics(tmp_path / "ddp" / "metrics.jsonl") if r.get("kind") == "eval"]
    assert len(evals) >= 2


def test_mlm_masks_do_not_depend_on_how_the_batch_is_split():
    from types import SimpleNamespace

    from transnormer.data.lm import LMBatchIterator, eval_batches
    from transnormer.train.tasks import MLMBatches

    tokens = torch.arange(5, 2000) % 295 + 5  # ids in [5, 300): the vocabulary
    tok = SimpleNamespace(mask_id=1, vocab_size=300, special_ids=[0, 1, 2])

    def masks(world, bs, accum=1, resume_from=None):
        parts = [MLMBatches(LMBatchIterator(tokens, 32, bs, seed=3, rank=r, world_size=world), tok, 7, r, world, accum)
                 for r in range(world)]
        if resume_from is not None:
            for p in parts:
                p.load_state_dict(resume_from)
        # a step's global batch: its micro-batches in order, each the ranks' rows in order
        return [torch.cat([next(p)["labels"] for _ in range(accum) for p in parts]) for _ in range(3)]

    assert all(torch.equal(a, b) for a, b in zip(masks(1, 4), masks(2, 2), strict=True))
    # nor on the accumulation steps (the second micro-batch had been masked as the next step's first rows)
    assert all(torch.equal(a, b) for a, b in zip(masks(1, 8), masks(1, 4, accum=2), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(masks(1, 8), masks(2, 2, accum=2), strict=True))
    # a checkpoint from before keeps its run's keys: one micro-batch a step
    it = LMBatchIterator(tokens, 32, 4, seed=3)
    old = {**it.state_dict(), "step": 2}
    legacy = masks(1, 4, accum=2, resume_from=old)
    by_micro = MLMBatches(LMBatchIterator(tokens, 32, 4, seed=3, step=2), tok, 7, 0)
    assert torch.equal(legacy[0][:4], next(by_micro)["labels"])
    # and keeps them through its later checkpoints (it had saved the new keys at its first)
    first = MLMBatches(LMBatchIterator(tokens, 32, 4, seed=3), tok, 7, 0, 1, 2)
    first.load_state_dict(old)
    next(first)
    again = MLMBatches(LMBatchIterator(tokens, 32, 4, seed=3), tok, 7, 0, 1, 2)
    again.load_state_dict(first.state_dict())
    assert again.micro_batch_keys and first.state_dict()["mask_keys"] == "micro-batch"
    torch.testing.assert_close(next(again)["labels"], next(first)["labels"])
    assert MLMBatches(it, tok, 7, 0).state_dict()["mask_keys"] == "optimizer-step"
    masker = MLMBatches(None, tok, 11, 0)

    def eval_masks(world):
        rows = {}
        for r in range(world):
            for b in eval_batches(tokens, 32, 3, rank=r, world_size=world, with_index=True):
                idx = b.pop("window").tolist()
                for i, row in zip(idx, masker.masked(b, 0, rows=idx)["labels"], strict=True):
                    rows[i] = row
        return rows

    one, two = eval_masks(1), eval_masks(2)
    assert one.keys() == two.keys() and all(torch.equal(one[i], two[i]) for i in one)


def test_mlm_micro_batches_weigh_in_by_their_masked_tokens():
    from transnormer.train.loop import micro_weights

    lab = [torch.tensor([[5, -100, 7, 8]]), torch.tensor([[-100, -100, 9, -100]])]
    assert micro_weights([{"labels": x} for x in lab], "mlm", DistInfo()) == [0.75, 0.25]
    assert micro_weights([{"labels": x} for x in lab], "clm", DistInfo()) == [0.5, 0.5]
    assert micro_weights([{"labels": torch.full((1, 4), -100)}] * 2, "mlm", DistInfo()) is None  # nothing masked


def test_an_mlm_step_that_masks_nothing_has_no_loss_and_updates_nothing(corpus_dir, tmp_path):
    # such steps had been logged as loss 0.0 (and could be final_train_loss), while AdamW still moved
    # the weights on its momentum
    from safetensors.torch import load_file

    cfg = cfg_for(corpus_dir, tmp_path, task="mlm", preset="t2-roberta-tiny", seq_len=8, batch_size=1, max_steps=12,
                  eval_every=0, save_every=1, keep_last=12, mlm_packing="contiguous", weight_decay=0.1)
    s = train(cfg)
    recs = [r for r in read_metrics(Path(cfg.out_dir) / "metrics.jsonl") if r["kind"] == "train"]
    empty = [r["step"] for r in recs if r.get("no_targets")]
    assert empty and all(r["loss"] is None for r in recs if r["step"] in empty)
    assert all(r["loss"] > 0 for r in recs if r["step"] not in empty)
    assert s["final_train_loss"] == next(r["loss"] for r in reversed(recs) if r["loss"] is not None)
    step = next(t for t in empty if t > 1)
    before, after = (load_file(str(Path(cfg.out_dir) / "checkpoints" / f"step-{t:08d}" / "model.safetensors"))
                     for t in (step - 1, step))
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_cls_evaluation_of_a_rank_without_examples():
    """A split smaller than the number of ranks leaves a rank empty: it had crashed on torch.cat([])."""
    from transnormer.train.evaluate import evaluate_classifier

    res = evaluate_classifier(torch.nn.Linear(1, 1), [], None, DistInfo(rank=1, world_size=1), 4, None, contextlib.nullcontext)
    assert res["n"] == 0


def test_a_time_budgets_schedule_is_fitted_without_the_first_steps_one_off_costs():
    """The first step of a process carries one-off costs (the CPU kernels built at first use): a
    fresh clone's demo ran 13.7 s, then ~0.12 s a step, and the schedule fitted to the mean had
    decayed to its floor by step 19 of ~570. The fit reads the steps after the first; a run
    resumed just before the fit step fits once it has two steps of its own, to the budget left."""
    from transnormer.train.loop import fit_total_steps

    dts = [13.7] + [0.12] * 4
    got = fit_total_steps(5, sum(dts), 90.0, dts[1:])
    assert abs(got - (5 + (90.0 - sum(dts)) / 0.12)) <= 1  # ~630 steps, not 90 / (14.18 / 5) = 31
    # resumed at step 4 after 20 s: its first step (kernels built again) slow, its second not
    got = fit_total_steps(6, 20.0 + 12.12, 90.0, [0.12])
    assert abs(got - (6 + (90.0 - 32.12) / 0.12)) <= 1
    assert fit_total_steps(5, 100.0, 90.0, [1.0]) == 6  # past the budget: at least one more
    # a slow spell of the shared machine in the first steps does not stand for the run (the mean of
    # 0.12, 2.28, 0.12 had fitted 42 steps to a run that took 234)
    dts = [1.0, 0.12, 2.28, 0.12]
    assert abs(fit_total_steps(4, sum(dts), 40.0, dts[1:]) - (4 + (40.0 - sum(dts)) / 0.12)) <= 1


def test_a_time_budgets_schedule_is_refitted_as_the_run_goes(corpus_dir, tmp_path, monkeypatch):
    """Fitted once at step 5, a schedule kept whatever a slow spell there made of it. The loop's
    clock is a fake one on which every step takes 50 ms: on the real clock a slow spell of the
    shared machine (steps of ~0.4 s, once in a suite run) ended the 6 s budget before step 17."""
    import time

    import transnormer.train.loop as loop

    class FakeClock:  # the loop's `time` module, its perf_counter 50 ms later at every call
        now = 0.0

        def perf_counter(self):
            self.now += 0.05
            return self.now

        def __getattr__(self, name):
            return getattr(time, name)

    fits = []
    real_fit = loop.fit_total_steps
    monkeypatch.setattr(loop, "fit_total_steps", lambda *a: fits.append(a[0]) or real_fit(*a))
    monkeypatch.setattr(loop, "time", FakeClock())
    s = train(cfg_for(corpus_dir, tmp_path, max_steps=None, budget="2s", eval_batches=1))
    assert fits[:3] == [5, 9, 17] and all(b == 2 * a - 1 for a, b in zip(fits, fits[1:])), fits
    assert s["steps"] > fits[-1]
    lrs = [(r["step"], r["lr"]) for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    lrs = [lr for step, lr in lrs if step > 2]  # past the warmup: it never rises (the refits had raised it)
    assert len(lrs) > 2 and all(b <= a * (1 + 1e-12) for a, b in zip(lrs, lrs[1:])), lrs


def test_a_refitted_schedule_continues_its_decay():
    """A refit that lengthens the schedule had recomputed the progress from the warmup, so the
    cosine lr rose again at each longer fit; it now decays on from where it stands, to the floor
    at the new end. Shorter fits too."""
    from transnormer.train.schedule import lr_multiplier, make_scheduler, refit

    for new_total in (400, 60):
        params = {"kind": "cosine", "warmup": 10, "total_steps": 100, "min_lr_ratio": 0.1, "warmup_init_ratio": 0.0}
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        sched = make_scheduler(opt, params)
        lrs = []
        for step in range(new_total + 5):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
            if step + 1 == 50:  # the loop refits after scheduler.step(), the next step's lr already set
                before = lr_multiplier(50, **{k: v for k, v in params.items()})
                refit(params, new_total, 50)
                assert lr_multiplier(50, **params) == pytest.approx(before)  # continuous
        assert all(b <= a + 1e-12 for a, b in zip(lrs[10:], lrs[11:])), new_total
        # the last update (new_total) reads the decay one update back: above the floor, which follows
        assert lrs[new_total - 1] > 0.1 and lrs[new_total] == pytest.approx(0.1) and lrs[-1] == pytest.approx(0.1)
        assert lrs[60] > 0.1 if new_total == 400 else True


def test_schedules_and_budgets():
    from transnormer.train import parse_budget
    from transnormer.train.schedule import lr_multiplier

    kw = dict(warmup=10, total_steps=110)
    assert lr_multiplier(4, kind="cosine", **kw) == pytest.approx(0.5)
    # cosine, as polynomial: update k reads the decay at k - 1 (at min_lr_ratio 0, the LRA default, the
    # last update had run at lr 0, and a one-step run never moved); a run saved before keeps its lag 0
    assert lr_multiplier(10, kind="cosine", **kw) == pytest.approx(1.0)
    assert lr_multiplier(109, kind="cosine", min_lr_ratio=0.1, **kw) > 0.1
    assert lr_multiplier(109, kind="cosine", min_lr_ratio=0.1, cosine_lag=0, **kw) == pytest.approx(0.1)
    assert lr_multiplier(0, kind="cosine", warmup=0, total_steps=1, min_lr_ratio=0.0) == 1.0
    assert lr_multiplier(39, kind="inverse_sqrt", **kw) == pytest.approx((10 / 40) ** 0.5)
    assert lr_multiplier(0, kind="inverse_sqrt", warmup=8000, total_steps=1, warmup_init_ratio=1e-7 / 5e-4) > 2e-4
    # polynomial, as fairseq: update k reads the decay at k - 1 (the last update had run at lr 0)
    assert lr_multiplier(10, kind="polynomial", **kw) == pytest.approx(1.0)
    assert lr_multiplier(109, kind="polynomial", **kw) == pytest.approx(0.01)
    assert parse_budget("90s") == ("seconds", 90) and parse_budget("5min") == ("seconds", 300)
    assert parse_budget("200k") == ("tokens", 200_000) and parse_budget("2M") == ("tokens", 2_000_000)
    with pytest.raises(ValueError, match="budget"):
        parse_budget("soon")
    with pytest.raises(ValueError, match=r"budget '2m' is ambiguous: write '2min' \(minutes\) or '2M'"):
        parse_budget("2m")
    with pytest.raises(ValueError, match="schedule"):
        lr_multiplier(0, kind="linear", warmup=1, total_steps=2)


def test_a_cosine_run_saved_before_the_lag_resumes_on_its_own_rates(corpus_dir, tmp_path):
    """The cosine now reads the decay one update back; a run saved before (no cosine_lag in its
    schedule) continues on the rates it started with."""
    import torch as _torch

    from transnormer.train.checkpoint import STATE

    c = cfg_for(corpus_dir, tmp_path, max_steps=6, warmup=1, save_every=3, schedule="cosine", min_lr_ratio=0.0)
    train(replace(c, stop_after=3))
    ckpt = Path(c.out_dir) / "checkpoints" / "step-00000003"
    state = _torch.load(ckpt / STATE, weights_only=False)
    del state["sched"]["cosine_lag"]  # as saved before
    _torch.save(state, ckpt / STATE)
    manifest = json.loads((ckpt / "manifest.json").read_text())  # (the manifest's hash of the edited file)
    import hashlib

    manifest["files"][STATE] = {"size": (ckpt / STATE).stat().st_size,
                                "sha256": hashlib.sha256((ckpt / STATE).read_bytes()).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    train(replace(c, resume=True))
    lrs = [r["lr"] for r in read_metrics(Path(c.out_dir) / "metrics.jsonl") if r["kind"] == "train"]
    assert lrs[-1] == 0.0  # lag 0: the last update at the floor, as the run had started
    fresh = replace(c, out_dir=str(tmp_path / "fresh"))
    train(fresh)
    assert [r["lr"] for r in read_metrics(Path(fresh.out_dir) / "metrics.jsonl") if r["kind"] == "train"][-1] > 0.0


def test_schedule_options_that_would_change_nothing_are_refused(tmp_path):
    # warmup_init_lr with warmup 1: the first update runs at the peak; min_lr_ratio with another schedule
    with pytest.raises(ValueError, match=r"warmup_init_lr=1e-07 needs warmup >= 2: .* with warmup 1 it changes nothing"):
        TrainConfig(max_steps=2, warmup=1, warmup_init_lr=1e-7, schedule="inverse_sqrt").check()
    with pytest.raises(ValueError, match="min_lr_ratio=0.0 applies to schedule 'cosine' only, not 'polynomial'"):
        TrainConfig(max_steps=2, min_lr_ratio=0.0, schedule="polynomial").check()
    TrainConfig(max_steps=2, warmup=2, warmup_init_lr=1e-7, schedule="inverse_sqrt").check()


def test_a_config_file_is_checked_for_misspelt_keys_and_keeps_its_positions(corpus_dir, tmp_path):
    """A config file's typo ("hiden_size") trained the unchanged model; and its max_position_embeddings
    was overwritten with max(seq_len, 512): learned positions of 2048 trained and saved as 512."""
    from transnormer.presets import get_config
    from transnormer.train.loop import model_config_for

    config = get_config("t2-lm-tiny", max_position_embeddings=2048, hidden_size=32, num_attention_heads=2,
                        num_hidden_layers=2)
    good = tmp_path / "good.json"
    config.to_json_file(good)
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({**json.loads(good.read_text()), "hiden_size": 64}))
    with pytest.raises(ValueError, match=r"config_file \(--config\) .*typo.json': 'hiden_size' is not a "
                                         r"TransNormerConfig field; did you mean 'hidden_size'"):
        TrainConfig(preset=None, config_file=str(typo), max_steps=1, out_dir=str(tmp_path / "r")).check()
    cfg = TrainConfig(preset=None, config_file=str(good), max_steps=1, seq_len=128, out_dir=str(tmp_path / "r"))
    cfg.check()  # a saved config.json (model_type, mixer_types, ...) is accepted
    old = tmp_path / "old.json"  # and transformers 4's torch_dtype
    old.write_text(json.dumps({**json.loads(good.read_text()), "torch_dtype": "float32"}))
    replace(cfg, config_file=str(old)).check()
    assert model_config_for(cfg, 300, None, {}).max_position_embeddings == 2048
    assert model_config_for(replace(cfg, seq_len=4096), 300, None, {}).max_position_embeddings == 4096
    preset = TrainConfig(preset="t2-lm-tiny", max_steps=1, seq_len=128, out_dir=str(tmp_path / "r"))
    assert model_config_for(preset, 300, None, {}).max_position_embeddings == 512  # presets as before


@pytest.mark.parametrize("field,value,match", [
    ("lr", 0.0, r"lr \(--lr\) must be > 0"), ("max_steps", 0, r"max_steps \(--max-steps\) must be >= 1"), ("eval_batches", 0, "eval_batches"),
    ("warmup", -5, r"warmup \(--warmup\) must be >= 0"), ("eval_every", -1, "eval_every"), ("save_every", -1, "save_every"),
    ("keep_last", -2, "keep_last"), ("log_every", 0, "log_every"),
    ("lr", float("inf"), r"lr \(--lr\) must be > 0 and finite"), ("min_lr_ratio", 3.0, r"min_lr_ratio \(--min-lr-ratio\) must be in \[0, 1\]"),
    ("budget", "0", r"budget \(--budget\) must be > 0"), ("budget", "0s", r"budget \(--budget\) must be > 0"),
    ("overrides", {"dropuot": 0.0}, "'dropuot' is not a TransNormerConfig field; did you mean 'dropout'"),
    ("overrides", {"dropout": "abc"}, "dropout='abc' must be float"),
    ("overrides", {"hidden_size": 32.5}, "hidden_size=32.5 must be int"),
    # Hugging Face's own keys: dtype=foo had been a traceback, model_type=foo lost on saving
    ("overrides", {"dtype": "bfloat16"}, r"'dtype' is written by Hugging Face .* \(the run's precision is --dtype\)"),
    ("overrides", {"model_type": "foo"}, "'model_type' is written by Hugging Face when a model is saved"),
    ("overrides", {"id2label": [1]}, r"id2label=\[1\] must be dict"),
    ("overrides", {"id2label": {0: "a"}, "label2id": "a"}, "label2id=.a. must be dict"),
    ("cls_read_kwargs", {"text_column": 0}, "task 'cls' only"), ("no_truncate", True, "task 'cls' only"),
])
def test_bad_settings_are_refused_before_any_work(tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{"max_steps": 2, "out_dir": str(tmp_path / "run"), field: value}).check()


@pytest.mark.parametrize("field,value,err,match", [
    ("max_steps", 2.5, TypeError, r"max_steps \(--max-steps\) must be an int"),  # had trained 3 steps
    ("max_steps", True, TypeError, r"max_steps \(--max-steps\) must be an int"),  # had trained 1
    ("save_every", 1.5, TypeError, r"save_every \(--save-every\) must be an int"),
    ("grad_accum", 2.0, TypeError, r"grad_accum \(--grad-accum\) must be an int"),  # had failed after the data and model
    ("seq_len", "32", TypeError, r"seq_len \(--seq-len\) must be an int"),
    ("lr", "1e-3", TypeError, r"lr \(--lr\) must be a number"),
    ("seed", -1, ValueError, r"seed \(--seed\) must be in \[0, 2\*\*32\)"),  # had failed inside numpy
    ("warmup_init_lr", 1.0, ValueError, r"warmup_init_lr \(--warmup-init-lr\) must be <= lr"),
    ("adam_eps", 0.0, ValueError, r"adam_eps \(--adam-eps\) must be > 0"),
    ("betas", (0.9, 1.5), ValueError, r"betas \(--betas\) must be two numbers"),
    ("betas", (0.9,), ValueError, r"betas \(--betas\) must be two numbers"),
])
def test_wrongly_typed_settings_are_refused_before_any_work(tmp_path, field, value, err, match):
    with pytest.raises(err, match=match):
        TrainConfig(**{"max_steps": 2, "out_dir": str(tmp_path / "run"), field: value}).check()


def test_unusable_out_dir_is_refused_before_training(corpus_dir, tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match="cannot hold checkpoints"):
        train(cfg_for(corpus_dir, tmp_path, out_dir=str(tmp_path / "afile" / "run")))


def test_resume_refuses_changed_settings_and_a_finished_run_trains_nothing(corpus_dir, tmp_path, monkeypatch):
    cfg = cfg_for(corpus_dir, tmp_path, max_steps=4)
    first = train(cfg)
    records = read_metrics(Path(cfg.out_dir) / "metrics.jsonl")
    with pytest.raises(ValueError, match=r"max_steps: 4 -> 8"):
        train(cfg_for(corpus_dir, tmp_path, max_steps=8, resume=True))
    with pytest.raises(ValueError, match=r"lr: 0.003 -> 0.001"):
        train(cfg_for(corpus_dir, tmp_path, max_steps=4, lr=1e-3, resume=True))
    with pytest.raises(ValueError, match=r"resume: .*global_batch_size: saved 4, now 2.*--batch-size x processes"):
        train(cfg_for(corpus_dir, tmp_path, max_steps=4, batch_size=2, resume=True))
    import transnormer.train.loop as loop

    monkeypatch.setattr(loop, "peak_memory_mb", lambda info: 1.0)  # a process that trains nothing
    summary = train(cfg_for(corpus_dir, tmp_path, max_steps=4, resume=True, eval_every=2))  # reporting may change
    assert first["peak_mem_mb"] >= summary["peak_mem_mb"] > 100  # the training process's (at its last checkpoint)
    final_eval = [r for r in records if r.get("kind") == "eval"][-1]
    assert summary["steps"] == 4 and summary["eval"]["loss"] == final_eval["loss"]
    assert read_metrics(Path(cfg.out_dir) / "metrics.jsonl") == records  # no second evaluation of step 4


def test_resume_refuses_ranks_that_found_different_checkpoints(corpus_dir, tmp_path, monkeypatch):
    # --out on storage rank 1 does not share: it had started from step 0 beside rank 0's step 4
    import transnormer.train.loop as loop

    train(cfg_for(corpus_dir, tmp_path, max_steps=4, save_every=2))
    monkeypatch.setattr(loop, "gather_objects", lambda obj, info: [obj, None])  # as rank 1 would report
    with pytest.raises(ValueError, match=r"different checkpoints .*\['step-00000004', None\]"):
        train(cfg_for(corpus_dir, tmp_path, max_steps=4, save_every=2, resume=True))


def test_logged_lr_is_the_one_the_step_used(corpus_dir, tmp_path):
    cfg = cfg_for(corpus_dir, tmp_path, max_steps=3, warmup=2)
    train(cfg)
    lrs = [r["lr"] for r in read_metrics(Path(cfg.out_dir) / "metrics.jsonl") if r["kind"] == "train"]
    assert lrs[0] < lrs[1] == pytest.approx(cfg.lr)  # warm-up: step 1 at a fraction, step 2 at the peak


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an fd through /proc (Linux)")
def test_a_checkpoint_reaches_the_disk_before_older_ones_are_pruned(tmp_path, monkeypatch):
    """Atomic renames guard against a killed process, not a power loss: every file and folder of
    the new checkpoint, the rename and `latest` are flushed (fsync), before pruning."""
    import shutil

    import transnormer.train.checkpoint as ck
    from transnormer.presets import build_model

    model = build_model("t2-lm-tiny", vocab_size=50, hidden_size=16, num_attention_heads=2, num_hidden_layers=1)
    root = tmp_path / "checkpoints"
    ck.save_checkpoint(root, 1, model, {"step": 1}, keep_last=1)
    events, real_fsync, real_rmtree = [], os.fsync, shutil.rmtree
    monkeypatch.setattr(ck.os, "fsync", lambda fd: events.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    monkeypatch.setattr(ck.shutil, "rmtree", lambda p, **kw: events.append(("pruned", str(p))) or real_rmtree(p, **kw))
    final = ck.save_checkpoint(root, 2, model, {"step": 2}, keep_last=1)
    pruned = events.index(("pruned", str(root / "step-00000001")))
    synced = {Path(e).name for e in events[:pruned] if isinstance(e, str)}
    written = {p.name for p in final.rglob("*")}
    assert written <= synced and "checkpoints" in synced, written - synced  # the files and the root folder
    assert any(n.startswith(".latest-") for n in synced)  # `latest` before its rename into place


def test_overwriting_a_checkpoint_survives_a_kill(tmp_path, monkeypatch):
    """Re-saving step N moves the old copy aside before the new one is renamed in; a kill between the
    two leaves the old copy, which the next listing puts back. Stale temporary writes are removed."""
    from transnormer.presets import build_model
    from transnormer.train.checkpoint import list_checkpoints, save_checkpoint

    model = build_model("t2-lm-tiny", vocab_size=50, hidden_size=16, num_attention_heads=2, num_hidden_layers=1)
    root = tmp_path / "checkpoints"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()  # the pid of a process that has exited
    ckpt = save_checkpoint(root, 4, model, {"step": 4})
    umask = os.umask(0)
    os.umask(umask)  # every file readable as the process's other outputs (safetensors had written 0600)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in ckpt.rglob("*") if p.is_file()}["model.safetensors"] == \
        oct(0o666 & ~umask)
    # a writer that is alive is between its two renames: a reader must not put its old copy back
    # (its second rename would then fail and the new checkpoint be lost)
    ckpt.rename(root / f".old-step-00000004-{os.getppid()}")
    assert list_checkpoints(root) == []
    (root / f".old-step-00000004-{os.getppid()}").rename(ckpt)
    (root / f".tmp-step-00000004-{dead}").mkdir()  # a write killed earlier
    ckpt.rename(root / f".old-step-00000004-{dead}")  # killed between the two renames of an overwrite
    assert [p.name for p in list_checkpoints(root)] == ["step-00000004"]
    verify_checkpoint(root / "step-00000004")
    save_checkpoint(root, 4, model, {"step": 4})
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000004"]
    # a writer on another host (a shared filesystem): its pid means nothing here, so its folder is
    # put back only once it is stale (it had been restored at once, as if that pid were dead here)
    import socket
    import time

    import transnormer.train.checkpoint as ck

    other = root / f".old-step-00000004-{os.getppid()}@not-{socket.gethostname()}"
    ckpt.rename(other)
    assert list_checkpoints(root) == []
    later = time.time() + ck.ASIDE_STALE_S + 5  # (a ctime cannot be set back: the clock moves on instead)
    monkeypatch.setattr(ck.time, "time", lambda: later)
    assert [p.name for p in list_checkpoints(root)] == ["step-00000004"]
    # this host's writer id, as save_checkpoint names its folder
    assert ck._writer_id() == f"{os.getpid()}@{socket.gethostname()}"


@pytest.mark.parametrize("kw,err,match", [
    ({"rank": 2, "world_size": 2}, ValueError, "rank must be < world_size=2"),  # had overlapped rank 0's batches
    ({"rank": -1, "world_size": 2}, ValueError, "rank must be >= 0"),  # had given empty batches
    ({"batch_size": 0}, ValueError, "batch_size must be >= 1"),  # had been a ZeroDivisionError
    ({"world_size": 0}, ValueError, "world_size must be >= 1"),
    ({"batch_size": 2.0}, TypeError, "batch_size must be an int"),
    ({"seed": None}, TypeError, "seed must be an int"),  # had failed at the first batch, inside numpy
    ({"seed": -1}, ValueError, "seed must be >= 0"),
])
def test_sampler_refuses_bad_arguments(kw, err, match):
    from transnormer.data.sampler import StepBatchSampler

    with pytest.raises(err, match=match):
        StepBatchSampler(10, **{"batch_size": 2, **kw})


def test_sampler_refuses_a_negative_step():
    from transnormer.data.sampler import StepBatchSampler

    with pytest.raises(ValueError, match="step must be >= 0"):  # had been a TypeError indexing None
        StepBatchSampler(10, 2).indices_at(-1)


def test_sampler_refuses_a_state_from_other_data():
    from transnormer.data.sampler import StepBatchSampler

    state = StepBatchSampler(100, 4, seed=1, world_size=2).state_dict()
    StepBatchSampler(100, 8, seed=1, world_size=1).load_state_dict(state)  # same global batch: fine
    for kw, key in ((dict(num_items=100, batch_size=4, seed=2, world_size=2), "seed"),
                    (dict(num_items=100, batch_size=4, seed=1, world_size=1), "global_batch_size"),
                    (dict(num_items=90, batch_size=4, seed=1, world_size=2), "num_items")):
        n = kw.pop("num_items")
        with pytest.raises(ValueError, match=key):
            StepBatchSampler(n, **kw).load_state_dict(state)
    with pytest.raises(ValueError, match=r"state\['step'\] must be >= 0"):  # numpy had raised at the next batch
        StepBatchSampler(100, 4, seed=1, world_size=2).load_state_dict({**state, "step": -3})
    for bad in (None, [1, 2], {"seed": 1}):  # None and a list had failed inside the key loop, unexplained
        with pytest.raises(TypeError, match="state must be a dict from StepBatchSampler.state_dict"):
            StepBatchSampler(100, 4, seed=1, world_size=2).load_state_dict(bad)


def test_a_short_split_is_named_with_what_needs_it():
    """The message says what the split was for, not what its name suggests (an eval of the train
    split had read 'fewer than the 2 training needs')."""
    from types import SimpleNamespace

    from transnormer.train.tasks import _split_tokens

    cfg = SimpleNamespace(data="tiny", seq_len=8)
    with pytest.raises(ValueError, match="train split of 'tiny' has 1 tokens, fewer than the 2 evaluation needs"):
        _split_tokens(cfg, {"train": [5]}, "train", "evaluation")
    with pytest.raises(ValueError, match="fewer than the 9 training needs"):
        _split_tokens(cfg, {"train": [5]}, "train", "training")
    assert _split_tokens(cfg, {"valid": [1, 2]}, "valid", "evaluation") == [1, 2]


def test_cli_model_dir_skips_a_corrupt_newest_checkpoint(corpus_dir, tmp_path):
    from transnormer.cli import resolve_model_dir

    cfg = cfg_for(corpus_dir, tmp_path, max_steps=4, save_every=2)
    train(cfg)
    weights = Path(cfg.out_dir) / "checkpoints" / "step-00000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert resolve_model_dir(cfg.out_dir).name == "step-00000002"


def test_lm_evaluation_keeps_the_models_mode_and_reports_exp_of_its_loss():
    # the model came back in training mode (dropout on) whatever it was in; ppl was capped at e^50
    import contextlib
    import math

    from transnormer.presets import build_model
    from transnormer.train.distributed import DistInfo
    from transnormer.train.tasks import _eval_lm

    torch.manual_seed(0)
    lm = build_model("t2-lm-tiny", vocab_size=50)
    ids = torch.randint(0, 50, (2, 16))
    batches = [{"input_ids": ids, "labels": ids}]
    for training in (False, True):
        lm.train(training)
        _eval_lm(lm, iter(batches), DistInfo(), None, contextlib.nullcontext, shift=True)
        assert lm.training is training
    with torch.no_grad():
        lm.lm_head.weight.mul_(200.0)  # a loss far above 50
    res = _eval_lm(lm, iter(batches), DistInfo(), None, contextlib.nullcontext, shift=True)
    assert res["loss"] > 60 and res["ppl"] == pytest.approx(math.exp(res["loss"]) if res["loss"] < 709 else math.inf)


def test_mlm_evaluation_scores_each_token_once():
    """Evaluation windows overlap at the end of a split; the masker keeps the -100 that marks tokens
    an earlier window scored."""
    import numpy as np

    from transnormer.data.lm import eval_batches
    from transnormer.train.tasks import MLMBatches

    class Tok:
        mask_id, vocab_size, special_ids = 4, 2000, [0, 1, 2, 3, 4]

    masker, scored, overlap = MLMBatches(None, Tok(), 0, 0), np.zeros(1010, int), 0
    for i, batch in enumerate(eval_batches(np.arange(10, 1010), 128, 4)):
        out = masker.masked(batch, i)
        seen_before = batch["labels"] == -100
        overlap += int(seen_before.sum())
        assert (out["labels"][seen_before] == -100).all()
        for labels, ids in zip(out["labels"], batch["input_ids"]):
            scored[ids[labels != -100].numpy()] += 1
    assert overlap > 0 and scored.max() == 1 and scored.sum() > 100


def test_fine_tuning_from_a_run_directory_keeps_its_tokenizer(corpus_dir, tmp_path):
    """--init-from takes a run directory (its newest checkpoint), and the fine-tuning run reads text
    with the pretrained model's tokenizer: its embeddings are indexed by those ids."""
    pre = cfg_for(corpus_dir, tmp_path, task="mlm", preset="t2-roberta-tiny", max_steps=2,
                  out_dir=str(tmp_path / "mlm"))
    train(pre)
    rng = random.Random(2)
    lines = ["sentence\tlabel"] + [f"{' '.join(rng.choice(WORDS) for _ in range(8))}\t{i % 2}" for i in range(40)]
    (tmp_path / "cls").mkdir()
    (tmp_path / "cls" / "train.tsv").write_text("\n".join(lines) + "\n")
    (tmp_path / "cls" / "dev.tsv").write_text("\n".join(lines[:9]) + "\n")
    fine = TrainConfig(task="cls", preset=None, init_from=str(tmp_path / "mlm"), data=str(tmp_path / "cls"),
                       seq_len=16, batch_size=4, max_steps=2, out_dir=str(tmp_path / "cls-run"), progress=False,
                       cache_dir=str(tmp_path / "cache"))
    summary = train(fine)
    assert summary["steps"] == 2
    ckpts = sorted((tmp_path / "mlm" / "checkpoints").glob("step-*"))
    pretrained = (ckpts[-1] / "tokenizer" / "tokenizer.json").read_text()
    tuned = next((tmp_path / "cls-run" / "checkpoints").glob("step-*")) / "tokenizer" / "tokenizer.json"
    assert tuned.read_text() == pretrained


def test_a_fresh_run_in_a_used_out_dir_starts_its_own_metrics_and_checkpoints(corpus_dir, tmp_path):
    """Without --resume a run owns out_dir from step 0: the earlier run's checkpoints are kept
    aside (their higher steps would shadow this run's on resume) and its metrics do not mix in."""
    train(cfg_for(corpus_dir, tmp_path, max_steps=4, save_every=2))
    train(cfg_for(corpus_dir, tmp_path, max_steps=2))
    out = Path(cfg_for(corpus_dir, tmp_path).out_dir)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"] == [1, 2]
    root = out / "checkpoints"
    assert latest_valid_checkpoint(root, log=lambda *a: None).name == "step-00000002"
    (aside,) = root.glob("earlier-run-*")
    # its files go with its checkpoints: a new run without --grad-stats had kept the earlier grad_rsd.json
    assert sorted(p.name for p in aside.iterdir() if p.name != "tensorboard") == [
        "latest", "loss.png", "metrics.jsonl", "step-00000002", "step-00000004", "summary.json", "train_config.json"]
    assert json.loads((aside / "summary.json").read_text())["steps"] == 4


def test_the_last_step_is_logged_whatever_log_every(corpus_dir, tmp_path):
    every = train(cfg_for(corpus_dir, tmp_path / "a", max_steps=7))
    sparse = train(cfg_for(corpus_dir, tmp_path / "b", max_steps=7, log_every=5))
    steps = [r["step"] for r in read_metrics(Path(tmp_path / "b" / "run") / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == [1, 5, 7]  # step 7 had not been logged, and final_train_loss had been step 5's
    assert sparse["final_train_loss"] == every["final_train_loss"] == train_losses(tmp_path / "a" / "run")[-1]
    assert every["real_tokens"] == every["tokens"] == 7 * 4 * 32  # no padding in LM windows


def test_a_resume_drops_the_interrupted_steps_record_off_the_log_grid(tmp_path):
    # an interrupted run logs its last step wherever it falls; the run that goes on would not have
    # (metrics.jsonl, loss.png and the median tokens/s had held one record more than a straight run)
    from transnormer.train.metrics import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    records = [{"kind": "train", "step": s} for s in (1, 3, 4, 5)] + [{"kind": "eval", "step": 4}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    truncate_metrics(path, 4, redo=("train",))
    assert read_metrics(path) == [{"kind": "train", "step": 1}, {"kind": "train", "step": 3}, {"kind": "eval", "step": 4}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    truncate_metrics(path, 4, redo=("eval",))  # records before the step are kept, whatever their grid
    assert read_metrics(path) == [{"kind": "train", "step": s} for s in (1, 3, 4)]


def test_resuming_a_spent_time_budget_keeps_its_last_record(corpus_dir, tmp_path):
    """A time-budget run has no total_steps, so a resume took it for an interrupted one and dropped
    its last step's record (off the log grid: every 1000th); nothing logged it again, and summary.json gave
    an earlier step's loss as final_train_loss."""
    cfg = cfg_for(corpus_dir, tmp_path, max_steps=None, budget="2s", log_every=1000, save_every=0, eval_every=0)
    first = train(cfg)
    assert first["steps"] > 1  # the last step off the grid
    path = Path(cfg.out_dir) / "metrics.jsonl"
    before = read_metrics(path)
    again = train(replace(cfg, resume=True))
    assert read_metrics(path) == before and again["final_train_loss"] == first["final_train_loss"]
    assert [r["step"] for r in before if r["kind"] == "train"][-1] == first["steps"]


def test_a_run_no_longer_than_its_warmup_says_so(corpus_dir, tmp_path, capsys):
    """A time budget too short for the warm-up said so; --max-steps (or a token budget) did not,
    and the rate then never reached --lr."""
    train(cfg_for(corpus_dir, tmp_path / "a", max_steps=2, warmup=2))
    assert "the run has 2 steps, no more than warmup=2" in capsys.readouterr().out
    train(cfg_for(corpus_dir, tmp_path / "b", max_steps=3, warmup=2))
    assert "warming up" not in capsys.readouterr().out


def test_a_resume_with_another_log_every_keeps_the_records_logged_before(corpus_dir, tmp_path):
    """--log-every may change on resume; the earlier run's records off the new grid had been deleted
    (log every step to step 3, then every 2nd: steps 1, 2, 3 became 1, 2)."""
    cfg = cfg_for(corpus_dir, tmp_path, max_steps=6, save_every=3)
    assert train(replace(cfg, stop_after=3)) == {"stopped_at": 3}
    train(replace(cfg, resume=True, log_every=2))
    assert [r["step"] for r in read_metrics(Path(cfg.out_dir) / "metrics.jsonl") if r["kind"] == "train"] == \
        [1, 2, 3, 4, 6]


def test_compare_tabulates_a_classifiers_accuracy_not_perplexity(tmp_path):
    """compare --task cls had shown "valid ppl nan" for every model and no accuracy."""
    from transnormer.train.compare import comparison_table

    run = {"name": "t2-roberta-tiny", "params": 1e6, "steps": 5, "tokens": 640, "tokens_per_s": 100.0,
           "peak_mem_mb": 300.0, "eval": {"loss": 0.5, "accuracy": 0.75, "f1": 0.7, "mcc": 0.5, "n": 8}}
    lines = comparison_table([run, {**run, "diverged_at": 3}], TrainConfig(task="cls", max_steps=5)).splitlines()
    assert lines[2].endswith("| valid loss | accuracy | macro F1 | MCC |") and "ppl" not in lines[2]
    assert lines[4].endswith("| 0.5000 | 0.7500 | 0.7000 | 0.5000 |")
    assert lines[5].endswith("| diverged at step 3 | — | — | — |")
    assert {len(line.split("|")) for line in lines[2:]} == {len(lines[2].split("|"))}
    lm = comparison_table([{**run, "eval": {"loss": 2.0, "ppl": 7.39}}], TrainConfig(task="clm", max_steps=5))
    assert lm.splitlines()[4].endswith("| 2.0000 | 7.39 |")
    # under torchrun the caption's batch says how many processes share it (it had read "batch 8x1")
    two = comparison_table([run], TrainConfig(task="clm", max_steps=5, batch_size=8), world_size=2)
    assert ", batch 8x1x2 processes," in two.splitlines()[0]


def test_resume_allows_what_does_not_change_the_training():
    from transnormer.train.loop import config_changes

    saved = json.loads(json.dumps(asdict(TrainConfig(max_steps=5)), default=str))
    # recomputation gives the same numbers: a run that ran out of memory may resume with it on
    assert config_changes(saved, TrainConfig(max_steps=5, gradient_checkpointing=True, compile=True)) == []
    assert config_changes(saved, TrainConfig(max_steps=5, lr=1.0)) == ["lr: 0.001 -> 1.0"]


def test_runs_saved_under_the_earlier_model_rules_resume_as_they_were(corpus_dir, tmp_path, monkeypatch):
    """layer_options given are merged into the preset's now, and a --config file keeps its
    max_position_embeddings: a run saved before (the options replaced, the positions max(seq_len,
    512)) was refused on resume, whatever flags were given. It resumes under its own rules."""
    from transnormer.presets import get_config
    from transnormer.train import loop

    lo = {"flash": {"chunk_size": 16}}
    file = tmp_path / "cfg.json"
    get_config("t2-lm-tiny", max_position_embeddings=1024, hidden_size=32, num_attention_heads=2,
               num_hidden_layers=2).to_json_file(file)
    runs = [replace(cfg_for(corpus_dir, tmp_path, preset="flash-lm-tiny", max_steps=3, save_every=2,
                            out_dir=str(tmp_path / "lo")), overrides={"layer_options": lo}),
            replace(cfg_for(corpus_dir, tmp_path, preset=None, config_file=str(file), max_steps=3, save_every=2,
                            out_dir=str(tmp_path / "file")), overrides={})]
    for c in runs:
        with monkeypatch.context() as m:
            m.setattr(loop, "MODEL_RULES", 1)  # as a checkpoint without "model_rules" reads
            assert train(replace(c, stop_after=2)) == {"stopped_at": 2}
        assert train(replace(c, resume=True))["steps"] == 3
        config = json.loads((Path(c.out_dir) / "checkpoints" / "step-00000003" / "config.json").read_text())
        if c.config_file:
            assert config["max_position_embeddings"] == 512
        else:
            assert config["layer_options"] == lo  # as it was built: the preset's other options replaced
    fresh = replace(runs[0], out_dir=str(tmp_path / "new"))
    train(fresh)
    config = json.loads((Path(fresh.out_dir) / "checkpoints" / "step-00000003" / "config.json").read_text())
    assert config["layer_options"]["flash"]["chunk_size"] == 16 and "qk_dim" in config["layer_options"]["flash"]


def test_an_lra_runs_data_folder_saved_as_given_resumes_saved_resolved(tmp_path, monkeypatch):
    # lra train now saves its --root resolved: a run saved with it relative (or left out) resumes
    from transnormer.train.loop import config_changes

    (tmp_path / "lo").mkdir()
    (tmp_path / "data" / "lra").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for before, now in (("lra:listops:lo", f"lra:listops:{tmp_path / 'lo'}"),
                        ("lra:listops", f"lra:listops:{tmp_path / 'data' / 'lra'}")):
        saved = json.loads(json.dumps(asdict(TrainConfig(task="cls", data=before, max_steps=5)), default=str))
        assert config_changes(saved, TrainConfig(task="cls", data=now, max_steps=5)) == []
        other = TrainConfig(task="cls", data=now.replace("listops", "text"), max_steps=5)
        assert config_changes(saved, other)[0].startswith("data:")


def test_compare_refuses_a_repeated_preset(tmp_path):
    from transnormer.train.compare import compare

    with pytest.raises(ValueError, match="each preset once"):
        compare(["t2-lm-tiny", "t2-lm-tiny"], TrainConfig(max_steps=1, out_dir=str(tmp_path)))


def test_strategy_is_checked_before_any_work(tmp_path):
    """A bad strategy is refused right after the process group is up, not after data and model."""
    from transnormer.train.distributed import check_strategy

    check_strategy(DistInfo(world_size=2), "fsdp")
    check_strategy(DistInfo(world_size=1), "fsdp")  # one process: nothing to shard, runs as is
    with pytest.raises(ValueError, match="strategy must be"):
        train(TrainConfig(max_steps=1, strategy="zero3", out_dir=str(tmp_path / "run"), data="/nonexistent"))


def test_grad_stats_record_the_raw_gradient_and_survive_a_resume(corpus_dir, tmp_path):
    """G_t (spec §10) is the gradient's norm before clipping, and an interrupted run's norms are
    kept and continued on resume, as its metrics are: the resumed file equals an uninterrupted run's."""
    import json

    def norms(out_dir):
        recs = [json.loads(line) for line in open(Path(out_dir) / "grad_norms.jsonl")]
        return [r["step"] for r in recs], [r["grad_norm"] for r in recs]

    clip = cfg_for(corpus_dir, tmp_path / "a", out_dir=str(tmp_path / "clip"), grad_stats=True, clip=1e-3)
    s = train(clip)
    free = cfg_for(corpus_dir, tmp_path / "a", out_dir=str(tmp_path / "free"), grad_stats=True, clip=0)
    train(free)
    assert norms(clip.out_dir)[1][0] == pytest.approx(norms(free.out_dir)[1][0], rel=1e-6)  # same first gradient
    assert norms(clip.out_dir)[0] == list(range(1, 7)) and s["grad_stats"]["num_steps"] == 6

    part = cfg_for(corpus_dir, tmp_path / "b", out_dir=str(tmp_path / "part"), grad_stats=True, clip=1e-3,
                   save_every=2, stop_after=5)
    assert train(part) == {"stopped_at": 5}
    assert norms(part.out_dir)[0] == list(range(1, 6))  # kept at the interruption
    resumed = cfg_for(corpus_dir, tmp_path / "b", out_dir=str(tmp_path / "part"), grad_stats=True, clip=1e-3,
                      save_every=2, resume=True)  # from step 4's checkpoint: step 5 is repeated, not doubled
    s2 = train(resumed)
    assert norms(resumed.out_dir)[0] == list(range(1, 7))
    assert norms(resumed.out_dir)[1] == pytest.approx(norms(clip.out_dir)[1], rel=1e-6)
    assert s2["grad_stats"]["num_steps"] == 6 and s2["grad_stats"]["rsd"] == pytest.approx(s["grad_stats"]["rsd"])
    assert s2["grad_stats"]["missing_steps"] == 0
    rsd = json.loads((Path(resumed.out_dir) / "grad_rsd.json").read_text())
    assert rsd["step_range"] == [1, 6]
    fresh = cfg_for(corpus_dir, tmp_path / "b", out_dir=str(tmp_path / "part"), max_steps=2)  # no --grad-stats
    train(fresh)
    assert not (Path(fresh.out_dir) / "grad_norms.jsonl").exists()  # an earlier run's norms do not linger


def test_a_model_configured_with_return_dict_false_still_trains_and_evaluates(corpus_dir, tmp_path):
    """Internal callers read outputs by name: they ask for the dataclass whatever the config says."""
    cfg = cfg_for(corpus_dir, tmp_path, max_steps=2)
    cfg.overrides = {**cfg.overrides, "return_dict": False}
    s = train(cfg)
    assert s["steps"] == 2 and s["eval"]["loss"] > 0


def test_init_from_refuses_a_config_and_fixed_fields():
    """A pretrained model's config.json is its config: --config and shape overrides would be ignored."""
    with pytest.raises(ValueError, match=r"config_file \(--config\) or init_from"):
        TrainConfig(max_steps=1, init_from="runs/x", config_file="c.json").check()
    with pytest.raises(ValueError, match="only dropout.*hidden_size"):
        TrainConfig(max_steps=1, init_from="runs/x", overrides={"hidden_size": 64}).check()
    TrainConfig(max_steps=1, init_from="runs/x", overrides={"dropout": 0.0}).check()


@pytest.fixture(scope="module")
def mlm_run(corpus_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlm")
    cfg = cfg_for(corpus_dir, tmp, task="mlm", preset="t2-roberta-tiny", max_steps=2, out_dir=str(tmp / "mlm"))
    train(cfg)
    return Path(cfg.out_dir)


def test_clm_needs_a_causal_model(corpus_dir, tmp_path, mlm_run, capsys):
    """A bidirectional model trained as a causal LM sees the tokens it predicts: refused, from a
    preset, from a pretrained model, and in evaluation."""
    with pytest.raises(ValueError, match="task 'clm' needs a causal model.*causal=False"):
        train(cfg_for(corpus_dir, tmp_path, preset="t2-roberta-tiny", max_steps=1))
    with pytest.raises(ValueError, match="task 'clm' needs a causal model"):
        train(cfg_for(corpus_dir, tmp_path, preset=None, init_from=str(mlm_run), overrides={}, max_steps=1))
    from transnormer.cli import main

    assert main(["eval", "--model", str(mlm_run), "--task", "clm", "--data", str(corpus_dir), "--seq-len", "32",
                 "--cache-dir", str(tmp_path.parent / "cache"), "--max-batches", "1"]) == 2
    assert "is a TransNormerForMaskedLM (trained with --task mlm); --task clm needs" in capsys.readouterr().err


def test_init_from_applies_a_dropout_override(corpus_dir, tmp_path, mlm_run):
    import json

    cfg = cfg_for(corpus_dir, tmp_path, task="mlm", preset="t2-lm-tiny", init_from=str(mlm_run),
                  overrides={"dropout": 0.0}, max_steps=1)
    assert train(cfg)["name"] == str(mlm_run)  # not the defaulted preset's name
    (ckpt,) = (Path(cfg.out_dir) / "checkpoints").glob("step-*")
    assert json.loads((ckpt / "config.json").read_text())["dropout"] == 0.0


def test_vocab_size_below_the_tokenizer_is_refused(corpus_dir, tmp_path):
    cfg = cfg_for(corpus_dir, tmp_path, max_steps=1)
    cfg.overrides = {**cfg.overrides, "vocab_size": 10}
    with pytest.raises(ValueError, match="vocab_size 10 is below the tokenizer's 300 ids"):
        train(cfg)


def test_a_diverged_run_keeps_its_last_finite_checkpoint(corpus_dir, tmp_path, monkeypatch):
    """The weights turn NaN after step 5; step 6's loss is NaN. The run stops there, saves no
    checkpoint of the NaN weights and so keeps (keep_last=1) step 4's, and says it diverged."""
    from safetensors.torch import load_file

    from transnormer.train.checkpoint import list_checkpoints

    orig, calls = torch.optim.AdamW.step, []

    def step(self, *a, **k):
        out = orig(self, *a, **k)
        calls.append(1)
        if len(calls) == 5:
            with torch.no_grad():
                self.param_groups[0]["params"][0].fill_(float("nan"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    cfg = cfg_for(corpus_dir, tmp_path, max_steps=10, save_every=2, keep_last=1, eval_every=4)
    s = train(cfg)
    # the step-4 evaluation is not the run's result (compare had tabulated it as a finished run's)
    assert s["diverged_at"] == 6 and s["steps"] == 6 and s["eval"] is None
    # strict JSON: the NaN loss is null on disk (a bare NaN had been written, which strict parsers refuse)
    def refuse(c):
        raise ValueError(c)

    saved = json.loads((Path(cfg.out_dir) / "summary.json").read_text(), parse_constant=refuse)
    assert saved["final_train_loss"] is None and saved["diverged_at"] == 6
    (ckpt,) = list_checkpoints(Path(cfg.out_dir) / "checkpoints")
    assert ckpt.name == "step-00000004"
    assert all(bool(torch.isfinite(w).all()) for w in load_file(str(ckpt / "model.safetensors")).values())


def test_a_kill_before_the_final_evaluation_is_made_good_on_resume(corpus_dir, tmp_path, monkeypatch):
    import transnormer.train.tasks as tasks

    def killed(*a, **k):
        raise KeyboardInterrupt("killed during the final evaluation")

    with monkeypatch.context() as m:
        m.setattr(tasks, "_eval_lm", killed)
        with pytest.raises(KeyboardInterrupt):
            train(cfg_for(corpus_dir, tmp_path, max_steps=3))  # the final checkpoint is written first
    s = train(cfg_for(corpus_dir, tmp_path, max_steps=3, resume=True))
    evals = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [3] and s["eval"]["loss"] == evals[0]["loss"]


def test_classification_metrics_match_their_definitions():
    from transnormer.train.evaluate import classification_metrics

    # binary: TP 2, FP 1, TN 1, FN 1
    m = classification_metrics(torch.tensor([1, 1, 0, 0, 1]), torch.tensor([1, 0, 0, 1, 1]))
    assert m["accuracy"] == pytest.approx(3 / 5) and m["mcc"] == pytest.approx(1 / 6)
    assert m["f1_positive"] == pytest.approx(4 / 6) and m["f1"] == pytest.approx((2 / 4 + 4 / 6) / 2)
    # macro F1 over the gold and predicted classes (scikit-learn's): class 2, predicted once and never
    # gold, scores 0 (it had been left out of the mean)
    m = classification_metrics(torch.tensor([0, 0, 1, 2, 1, 0]), torch.tensor([0, 1, 1, 0, 1, 0]))
    assert m["accuracy"] == pytest.approx(4 / 6) and m["f1"] == pytest.approx((2 / 3 + 4 / 5 + 0) / 3)
    # a binary task whose evaluation holds no class 1 still reports the F1 of class 1
    m = classification_metrics(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long), num_classes=2)
    assert m["f1_positive"] == 0.0 and m["f1"] == 1.0 and m["accuracy"] == 1.0
    assert "f1_positive" not in classification_metrics(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long))


def test_cls_data_for_a_given_label_set_reads_only_its_splits(tmp_path):
    """build_task_data(labels=, splits=): the splits asked for, read against the labels given; a BPE
    trained on the data still reads the train file (it had been a KeyError once the files were
    filtered to the splits asked for), and without one the error says what to give."""
    from transnormer.data import LabelSet, Scores

    rng = random.Random(6)
    for split in ("train", "dev"):
        rows = [f"{' '.join(rng.choice(WORDS) for _ in range(6))}\t{rng.randint(0, 20) / 4}" for _ in range(10)]
        (tmp_path / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    cfg = TrainConfig(task="cls", preset="t2-roberta-tiny", data=str(tmp_path), vocab_size=300, seq_len=16,
                      batch_size=4, max_steps=1, cache_dir=str(tmp_path / "cache"))
    data = build_task_data(cfg, DistInfo(), lambda: contextlib.nullcontext(), labels=Scores(), splits=("valid",))
    assert data.train is None and data.num_labels == 1 and data.eval_split == "valid"
    # a regressor given whole-number labels (classes, by the look of them) is told so
    (tmp_path / "ints").mkdir()
    for split in ("train", "dev"):
        (tmp_path / "ints" / f"{split}.tsv").write_text("sentence\tlabel\nthe a\t1\nan of\t0\n")
    with pytest.warns(UserWarning, match="every label is a whole number, as class labels are"):
        build_task_data(replace(cfg, data=str(tmp_path / "ints")), DistInfo(), lambda: contextlib.nullcontext(),
                        labels=Scores(), splits=("valid",))
    with pytest.raises(ValueError, match="dev.tsv', line 2: label '[0-9.]*' is not in the label set \\['0', '1'\\] \\(the model's"):
        build_task_data(cfg, DistInfo(), lambda: contextlib.nullcontext(),
                        labels=LabelSet(["0", "1"], origin="the model's classes"), splits=("valid",))
    (tmp_path / "train.tsv").unlink()
    with pytest.raises(ValueError, match="no train file in .* to train a tokenizer on"):
        build_task_data(cfg, DistInfo(), lambda: contextlib.nullcontext(), labels=Scores(), splits=("valid",))


def test_regression_metrics_match_their_definitions():
    """Pearson against numpy's corrcoef; Spearman against ranks counted one by one (ties take the
    mean of the places they share, as scipy's rankdata), on data with ties in both vectors."""
    import numpy as np

    from transnormer.train.evaluate import regression_metrics

    def slow_ranks(x):
        return np.array([sum(y < v for y in x) + (sum(y == v for y in x) - 1) / 2 for v in x], dtype=float)

    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 64):
        gold = rng.integers(0, 6, n).astype(float) / 1.25  # STS-B-like scores with ties
        pred = np.round(gold + rng.normal(0, 1, n), 1)
        m = regression_metrics(torch.tensor(pred, dtype=torch.float32), torch.tensor(gold))
        assert m["n"] == n and m["mse"] == pytest.approx(float(np.mean((pred.astype(np.float32) - gold) ** 2)))
        if n > 1 and gold.std() > 0 and pred.std() > 0:
            p32 = pred.astype(np.float32).astype(float)
            assert m["pearson"] == pytest.approx(np.corrcoef(p32, gold)[0, 1], abs=1e-12)
            assert m["spearman"] == pytest.approx(np.corrcoef(slow_ranks(p32), slow_ranks(gold))[0, 1], abs=1e-12)
        else:  # one item, or a constant: no correlation
            assert np.isnan(m["pearson"]) and np.isnan(m["spearman"])
    assert np.isnan(regression_metrics(torch.zeros(0), torch.zeros(0))["pearson"])
    with pytest.raises(ValueError, match="pred and gold must hold as many values, got 3 and 4"):
        regression_metrics(torch.zeros(3), torch.zeros(4))
    # a model that predicts NaN has no correlation (its NaNs had been ranked: Spearman 1.0 here)
    m = regression_metrics(torch.full((5,), float("nan")), torch.arange(5.0))
    assert np.isnan(m["pearson"]) and np.isnan(m["spearman"]) and np.isnan(m["mse"])


def test_cls_evaluation_of_part_of_a_label_sorted_split_sees_every_class():
    """--task cls scored the split's first max_batches x batch rows: on a file sorted by label (negative
    reviews first), one class. It now takes a fixed random subset, as the LRA evaluation does."""
    from types import SimpleNamespace

    from transnormer.train.evaluate import evaluate_classifier

    class AlwaysZero(torch.nn.Module):
        config = SimpleNamespace(num_labels=2)

        def forward(self, input_ids, attention_mask, return_dict=True):
            return SimpleNamespace(logits=torch.tensor([[1.0, 0.0]]).expand(len(input_ids), 2))

    items = [{"input_ids": torch.tensor([5, 6]), "label": int(i >= 20)} for i in range(40)]

    def collate(rows):
        return {"input_ids": torch.stack([r["input_ids"] for r in rows]),
                "attention_mask": torch.ones(len(rows), 2, dtype=torch.long),
                "labels": torch.tensor([r["label"] for r in rows])}

    part = evaluate_classifier(AlwaysZero(), items, collate, DistInfo(), 4, 2, contextlib.nullcontext)
    assert part["n"] == 8 and 0.0 < part["accuracy"] < 1.0  # a prefix: 1.0 (class 0 only)
    assert part == evaluate_classifier(AlwaysZero(), items, collate, DistInfo(), 4, 2, contextlib.nullcontext)  # fixed
    whole = evaluate_classifier(AlwaysZero(), items, collate, DistInfo(), 4, None, contextlib.nullcontext)
    assert whole["n"] == 40 and whole["accuracy"] == 0.5


def test_mlm_with_a_tokenizer_without_a_mask_token_is_refused_up_front(monkeypatch, tmp_path):
    """--task mlm --tokenizer gpt2 had failed at the first step, after the model was built, with
    "mask_id must be an int ..., got None"."""
    from types import SimpleNamespace

    import transnormer.train.tasks as tasks

    tok = SimpleNamespace(name="no-mask", mask_id=None, pad_id=1)
    monkeypatch.setattr(tasks, "_token_splits", lambda cfg, info: (None, tok, {}))
    cfg = TrainConfig(task="mlm", preset="t2-roberta-tiny", data=str(tmp_path), max_steps=1)
    with pytest.raises(ValueError, match="tokenizer 'no-mask' has no mask token"):
        tasks.build_task_data(cfg, DistInfo(), contextlib.nullcontext)


def test_a_num_labels_override_must_agree_with_the_data(tmp_path):
    """--set num_labels=N passed the checks, then failed in get_config ("multiple values"), or with
    --config was silently replaced by the data's count."""
    from transnormer.train.loop import model_config_for

    def cfg(**kw):
        return TrainConfig(task="cls", preset="t2-roberta-tiny", data=str(tmp_path), max_steps=1, **kw)

    with pytest.raises(ValueError, match=r"num_labels=3, but the data's labels give 2 classes"):
        model_config_for(cfg(overrides={"num_labels": 3}), 300, 2, {})
    assert model_config_for(cfg(overrides={"num_labels": 2}), 300, 2, {}).num_labels == 2
    path = tmp_path / "config.json"
    model_config_for(cfg(), 300, 2, {}).to_json_file(path)
    with pytest.raises(ValueError, match="num_labels=5"):
        model_config_for(cfg(config_file=str(path), overrides={"num_labels": 5}), 300, 2, {})


def test_cls_without_a_dev_file_evaluates_its_train_split(tmp_path):
    rng = random.Random(3)
    lines = ["sentence\tlabel"] + [f"{' '.join(rng.choice(WORDS) for _ in range(8))}\t{i % 2}" for i in range(32)]
    (tmp_path / "train.tsv").write_text("\n".join(lines) + "\n")
    cfg = TrainConfig(task="cls", preset="t2-roberta-tiny", data=str(tmp_path / "train.tsv"), vocab_size=300,
                      seq_len=16, batch_size=8, max_steps=2, out_dir=str(tmp_path / "run"), progress=False,
                      cache_dir=str(tmp_path / "cache"))
    s = train(cfg)
    (ev,) = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r.get("kind") == "eval"]
    assert ev["split"] == "train" and s["eval"]["n"] == 32
    # compare's table says so: its column had read "valid loss" over the training split
    from transnormer.train.compare import comparison_table

    table = comparison_table([{**s, "name": "t2-roberta-tiny"}], cfg)
    assert "Scored on the training split (no dev file)" in table and "| train-split loss |" in table
    assert s["eval"]["eval_split"] == "train"


def test_cls_refuses_one_class_and_regresses_on_real_valued_scores(tmp_path):
    # one class had trained a regression head (HF: one output) towards index 0, reporting accuracy 1.0;
    # STS-B's scores had become unordered classes ("1.000" as "1", "0.200" as itself), then were
    # refused; they now train a regression head (one output, MSE) scored by Pearson and Spearman
    rng = random.Random(3)

    def write(labels):
        lines = ["sentence\tlabel"] + [f"{' '.join(rng.choice(WORDS) for _ in range(8))}\t{y}" for y in labels]
        (tmp_path / "train.tsv").write_text("\n".join(lines) + "\n")
        return TrainConfig(task="cls", preset="t2-roberta-tiny", data=str(tmp_path / "train.tsv"), vocab_size=300,
                           seq_len=16, batch_size=8, max_steps=1, out_dir=str(tmp_path / "run"), progress=False,
                           cache_dir=str(tmp_path / "cache"))

    with pytest.raises(ValueError, match="every training example has the label '1'; a classifier needs at least two"):
        train(write([1] * 16))
    summary = train(write(["0.200", "1.000", "3.800", "5"] * 4))
    assert {"pearson", "spearman", "mse"} <= set(summary["eval"]) and "accuracy" not in summary["eval"]
    assert summary["eval"]["loss"] == pytest.approx(summary["eval"]["mse"], rel=1e-6)
    from transnormer.cli import resolve_model_dir

    config = json.loads((resolve_model_dir(tmp_path / "run") / "config.json").read_text())
    assert config["problem_type"] == "regression" and len(config["id2label"]) == 1  # one output


def test_a_token_budget_and_max_steps_stop_at_whichever_comes_first(corpus_dir, tmp_path):
    s = train(cfg_for(corpus_dir, tmp_path, max_steps=6, budget="256"))  # 4 x 32 = 128 tokens a step
    assert s["steps"] == 2 and s["tokens"] == 256
    s = train(cfg_for(corpus_dir, tmp_path, max_steps=1, budget="256"))
    assert s["steps"] == 1


def test_nothing_evaluated_is_no_loss():
    """Zero scored tokens (e.g. zero batches) had reported loss 0, perplexity 1: a perfect model."""
    import math

    from transnormer.train.tasks import _eval_lm

    res = _eval_lm(torch.nn.Linear(1, 1), [], DistInfo(), None, contextlib.nullcontext, shift=True)
    assert math.isnan(res["loss"]) and res["eval_tokens"] == 0


@pytest.mark.parametrize("device,match", [
    ("foo", r"device \(--device\) must be 'cpu', 'cuda' or 'cuda:N', got 'foo'"),
    ("cuda", r"device \(--device\) 'cuda' is not available here"),
    ("cuda:0", r"device \(--device\) 'cuda:0' is not available here"),
    ("meta", r"device \(--device\) must be 'cpu', 'cuda' or 'cuda:N', got 'meta'"),  # had been accepted
])
def test_an_unusable_device_is_refused_up_front(device, match):
    from transnormer.train.distributed import setup_distributed

    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match=match):
        setup_distributed(device)


def test_an_explicit_gpu_index_with_several_processes_per_node_is_refused(monkeypatch):
    """Every rank would take that one GPU (NCCL refuses a duplicate GPU); refused before the device is touched."""
    from transnormer.train.distributed import setup_distributed

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # each process sees both GPUs
    with pytest.raises(ValueError, match="each takes its own GPU"):
        setup_distributed("cuda:1")
    if not torch.cuda.is_available():  # one visible GPU each: cuda:0 is every rank's own (then: absent here)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        with pytest.raises(ValueError, match="is not available here"):
            setup_distributed("cuda:0")


def test_rng_state_holds_the_runs_own_cuda_generator_only():
    """A state per visible GPU (get_rng_state_all) could not be restored where fewer GPUs are
    visible (IndexError on resume); a CPU run keeps none. Older checkpoints' lists still load."""
    from transnormer.train.checkpoint import rng_state, set_rng_state

    cpu = torch.device("cpu")
    state = rng_state(cpu)
    assert "cuda" not in state
    torch.manual_seed(3)
    want = torch.rand(3)
    torch.manual_seed(3)
    state = rng_state(cpu)
    torch.rand(5)
    set_rng_state({**state, "cuda": [torch.zeros(8, dtype=torch.uint8)] * 8}, cpu)  # an older GPU run's list
    assert torch.equal(torch.rand(3), want)


def test_compare_keeps_a_given_eval_every(corpus_dir, tmp_path):
    from transnormer.train.compare import compare

    base = cfg_for(corpus_dir, tmp_path, max_steps=4, eval_every=3, out_dir=str(tmp_path / "cmp"))
    compare(["t2-lm-tiny"], base)
    evals = [r["step"] for r in read_metrics(tmp_path / "cmp" / "t2-lm-tiny" / "metrics.jsonl") if r.get("kind") == "eval"]
    assert evals == [3, 4]  # not every step (4 steps // 8 evaluations per run)


@pytest.mark.slow
def test_fsdp_resume_keeps_each_ranks_batch_norm_statistics(corpus_dir, tmp_path):
    """Without synced batch norm each rank keeps running statistics of its own batches, and FSDP
    never aligns them; the checkpoint had saved rank 0's alone and given them to every rank, so the
    evaluation after a resume differed from the uninterrupted run's (found by a review)."""
    def cfg(out, **kw):
        c = cfg_for(corpus_dir, tmp_path, task="mlm", preset="t2-roberta-tiny", batch_size=2, max_steps=6,
                    eval_every=0, strategy="fsdp", out_dir=str(tmp_path / out), **kw)
        c.overrides = {**c.overrides, "norm_type": "batch", "dropout": 0.0, "attention_dropout": 0.0}
        return c

    run_runs_on_two_ranks(tmp_path, [("train", cfg("full")), ("train", cfg("part", save_every=4, stop_after=4))])
    run_runs_on_two_ranks(tmp_path, [("train", cfg("part", save_every=4, resume=True))])  # a later launch

    def records(run):
        return [(r["kind"], r["step"], r["loss"]) for r in read_metrics(tmp_path / run / "metrics.jsonl")]

    full, part = records("full"), records("part")
    assert any(kind == "eval" for kind, _, _ in full) and full == part


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_rank_evaluation_scores_the_model_it_saves(corpus_dir, tmp_path, strategy):
    """Without synced batch norm each rank evaluated its share with its own running statistics, so
    the run's eval record (5.663) was no one model's: `eval` of the checkpoint it saved gave 5.656."""
    import json

    c = cfg_for(corpus_dir, tmp_path, task="mlm", preset="t2-roberta-tiny", batch_size=2, max_steps=3,
                eval_every=0, strategy=strategy, out_dir=str(tmp_path / "bn"))
    c.overrides = {**c.overrides, "norm_type": "batch"}
    res = tmp_path / "eval.json"
    run_runs_on_two_ranks(tmp_path, [("train", c), (
        "cli", ["eval", "--model", c.out_dir, "--task", "mlm", "--data", c.data, "--seq-len", "32", "--batch-size", "2",
                "--max-batches", "2", "--cache-dir", c.cache_dir, "--out", str(res)])])
    logged = json.loads((tmp_path / "bn" / "summary.json").read_text())["eval"]
    scored = json.loads(res.read_text())
    assert logged["eval_tokens"] == scored["eval_tokens"]
    assert abs(logged["loss"] - scored["loss"]) < 1e-6


def test_ddp_resume_is_exact_when_ranks_draw_different_amounts(tmp_path):
    """cls pads each rank's batch to its own longest example, so dropout draws a different number
    of random numbers per rank: a resume that gave every rank rank 0's saved generators drifted
    (max |dW| 2e-4 after 3 steps)."""
    from safetensors.torch import load_file

    rng = random.Random(5)
    for split, n in (("train", 40), ("dev", 8)):
        lines = ["sentence\tlabel"] + [f"{' '.join(rng.choice(WORDS) for _ in range(rng.randint(2, 14)))}\t{i % 2}"
                                       for i in range(n)]
        (tmp_path / f"{split}.tsv").write_text("\n".join(lines) + "\n")

    def cfg(out, **kw):
        return ("train", dict(task="cls", preset="t2-roberta-tiny", data=str(tmp_path), vocab_size=300, seq_len=16,
                              batch_size=2, max_steps=6, save_every=3, eval_every=0, eval_batches=1, warmup=1,
                              out_dir=str(tmp_path / out), progress=False, cache_dir=str(tmp_path / "cache"), **kw))

    run_runs_on_two_ranks(tmp_path, [cfg("full"), cfg("split", stop_after=3)])
    run_runs_on_two_ranks(tmp_path, [cfg("split", resume=True)])  # a later launch: only what was saved
    a, b = (load_file(str(tmp_path / r / "checkpoints" / "step-00000006" / "model.safetensors"))
            for r in ("full", "split"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0


def test_pruning_never_costs_the_new_checkpoint_or_the_last_good_one(tmp_path):
    # keep_last counted folders by name: a newer corrupt step-6 (a run resumed from step 4) kept
    # its place while the fresh step-5 and the good step-4 were deleted: nothing left to resume
    import json

    from transnormer.presets import build_model
    from transnormer.train.checkpoint import latest_valid_checkpoint, save_checkpoint

    model = build_model("t2-lm-tiny", vocab_size=50, hidden_size=16, num_attention_heads=2, num_hidden_layers=1)
    root = tmp_path / "checkpoints"
    for s in (2, 4, 6):
        save_checkpoint(root, s, model, {"step": s})
    f = root / "step-00000006" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    save_checkpoint(root, 5, model, {"step": 5}, keep_last=2)
    names = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
    assert names == ["step-00000004", "step-00000005", "step-00000006"]
    assert latest_valid_checkpoint(root, log=lambda m: None).name == "step-00000005"
    # a manifest of the wrong shape, a copied step, a manifest without the model: reported, skipped
    (root / "step-00000006" / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no per-file size and sha256"):
        verify_checkpoint(root / "step-00000006")
    import shutil

    shutil.copytree(root / "step-00000005", root / "step-00000009")
    with pytest.raises(CheckpointError, match="holds step 5"):
        verify_checkpoint(root / "step-00000009")
    m = json.loads((root / "step-00000005" / "manifest.json").read_text())
    m["files"].pop("model.safetensors")
    (root / "step-00000004" / "manifest.json").write_text(json.dumps({**m, "step": 4}))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        verify_checkpoint(root / "step-00000004")


def test_model_dirs_without_latest_and_named_checkpoints_are_verified(tmp_path):
    from transnormer.presets import build_model
    from transnormer.train.checkpoint import resolve_model_dir, save_checkpoint

    model = build_model("t2-lm-tiny", vocab_size=50, hidden_size=16, num_attention_heads=2, num_hidden_layers=1)
    root = tmp_path / "run" / "checkpoints"
    ckpt = save_checkpoint(root, 2, model, {"step": 2})
    (root / "latest").unlink()  # killed before "latest" was written: the step folder still counts
    assert resolve_model_dir(tmp_path / "run") == ckpt
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):  # named directly: verified too
        resolve_model_dir(ckpt)


def test_the_model_config_names_the_tokenizer_special_ids():
    # config.json / generation_config.json kept the defaults 1 / 2 whatever the tokenizer said
    from transnormer.train.loop import model_config_for

    class Tok:
        pad_id, bos_id, eos_id = 4, None, 3

    config = model_config_for(TrainConfig(max_steps=1), 300, None, special_token_ids(Tok()))
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (4, None, 3)


def test_retrieval_init_from_applies_overrides_and_checks_the_vocabulary(tmp_path):
    from transnormer.models.dual_encoder import TransNormerDualEncoderForSequenceClassification as Dual
    from transnormer.presets import get_config
    from transnormer.train.lra_tasks import build_lra_model

    Dual(get_config("t2-lra-retrieval-tiny", dropout=0.0)).save_pretrained(tmp_path / "dual")
    cfg = TrainConfig(max_steps=1, task="cls", preset=None, init_from=str(tmp_path / "dual"),
                      overrides={"dropout": 0.3, "classifier_dropout": 0.5})
    model = build_lra_model(cfg, 200, 2, {}, pair=True)
    assert (model.config.dropout, model.config.classifier_dropout) == (0.3, 0.5)  # both were dropped
    with pytest.raises(ValueError, match="below the tokenizer's 1000000 ids"):
        build_lra_model(cfg, 10**6, 2, {}, pair=True)
    with pytest.raises(ValueError, match="is a model of 2 classes and the data has 3 classes"):
        build_lra_model(cfg, 200, 3, {}, pair=True)
    # one output is a regression (HF's rule), and the message says so, either way round
    with pytest.raises(ValueError, match="is a model of 2 classes and the data has real-valued scores"):
        build_lra_model(cfg, 200, 1, {}, pair=True)


def test_mlm_samples_are_whole_sentences_after_bos(corpus_dir, tmp_path):
    """The paper's recipe (fairseq --sample-break-mode complete): each sample is <s> then whole
    sentences, right-padded; masking never picks <s> or padding. 'contiguous' keeps the windows."""
    cfg = cfg_for(corpus_dir, tmp_path, task="mlm", preset="t2-roberta-tiny", seq_len=64)
    data = build_task_data(cfg, DistInfo(), lambda: contextlib.nullcontext())
    tok = data.tokenizer
    batch = next(data.train)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert ids.shape == (4, 64) and (ids[:, 0] == tok.bos_id).all() and (labels[:, 0] == -100).all()
    assert (labels[mask == 0] == -100).all() and (ids[mask == 0] == tok.pad_id).all()
    blocks = data.train.windows.blocks
    assert (blocks[:, 1] - blocks[:, 0]).max() <= 63
    is_end = data.train.windows.is_end
    stream = data.train.windows.tokens
    assert all(is_end[stream[b - 1]] or b - a == 63 for a, b in blocks.tolist())  # ends on a sentence end
    assert data.evaluate(_tiny_mlm(tok), max_batches=1)["eval_tokens"] > 0
    flat = build_task_data(replace(cfg, mlm_packing="contiguous"), DistInfo(), lambda: contextlib.nullcontext())
    assert "attention_mask" not in next(flat.train)


def test_mlm_evaluation_masks_do_not_follow_the_training_seed(corpus_dir, tmp_path):
    """The evaluation masks had been keyed on the training seed, and eval (no --seed) uses 0: a run
    trained with --seed 3 logged 6.2171 over 103 tokens, eval of its checkpoint 6.2229 over 94."""
    torch.manual_seed(0)
    model = None
    got = []
    for seed in (0, 3):
        cfg = cfg_for(corpus_dir, tmp_path, task="mlm", preset="t2-roberta-tiny", seq_len=64, seed=seed)
        data = build_task_data(cfg, DistInfo(), lambda: contextlib.nullcontext())
        model = model or _tiny_mlm(data.tokenizer).eval()
        got.append(data.evaluate(model, max_batches=2))
        assert next(data.train)["input_ids"].shape == (4, 64)
    assert got[0] == got[1] and got[0]["eval_tokens"] > 0


def _tiny_mlm(tok):
    from transnormer.presets import build_model

    return build_model("t2-roberta-tiny", task="mlm", vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, block_size=8, chunk_size=8)


def test_resume_takes_mlm_packing_none_as_complete():
    # a run started without --mlm-packing (None) resumed with --mlm-packing complete was refused;
    # a real change is refused by the data iterator's state check (test_data_mlm_blocks.py)
    from dataclasses import asdict

    from transnormer.train.loop import config_changes

    cfg = TrainConfig(task="mlm", max_steps=1, mlm_packing="complete")
    assert config_changes({**asdict(cfg), "mlm_packing": None}, cfg) == []


def test_resume_takes_the_same_data_path_spelled_another_way(tmp_path, monkeypatch):
    """A run given --data corpus.txt had refused --resume with --data /abs/path/corpus.txt."""
    from dataclasses import asdict

    from transnormer.train.loop import config_changes

    (tmp_path / "corpus.txt").write_text("a b c\n")
    (tmp_path / "other.txt").write_text("a b c\n")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    saved = asdict(TrainConfig(data="corpus.txt", max_steps=1))
    assert config_changes(saved, TrainConfig(data=str(tmp_path / "corpus.txt"), max_steps=1)) == []
    assert config_changes(saved, TrainConfig(data=str(tmp_path / "sub" / ".." / "corpus.txt"), max_steps=1)) == []
    assert config_changes(saved, TrainConfig(data="other.txt", max_steps=1)) == ["data: 'corpus.txt' -> 'other.txt'"]
    assert config_changes(asdict(TrainConfig(data="stdlib", max_steps=1)), TrainConfig(data="corpus.txt", max_steps=1))


@pytest.mark.parametrize("field,value,match", [
    ("warmup_init_lr", 1e-4, "warmup_init_lr=0.0001 needs warmup >= 2"),
    ("overrides", {"num_labels": 7}, "num_labels applies to task 'cls' only"),
])
def test_settings_that_would_change_nothing_are_refused(tmp_path, field, value, match):
    kw = {"warmup": 0} if field == "warmup_init_lr" else {}
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{"max_steps": 2, "out_dir": str(tmp_path / "run"), field: value, **kw}).check()


def test_a_refused_run_leaves_no_checkpoints_folder(corpus_dir, tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):  # refused after the out_dir check, before training
        train(cfg_for(corpus_dir, tmp_path, overrides={"vocab_size": 10}))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_lm_evaluation_reads_its_batches_one_at_a_time():
    """Only an FSDP model needs its evaluation batches counted up front; a whole split had been
    held in memory before the first forward."""
    import contextlib

    from transnormer.presets import build_model
    from transnormer.train.distributed import DistInfo
    from transnormer.train.tasks import _eval_lm

    model = build_model("t2-lm-tiny", vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    made = []

    def batches():
        for _ in range(4):
            made.append(1)
            ids = torch.randint(1, 40, (1, 8))
            yield {"input_ids": ids, "labels": ids}

    forward = model.forward
    at_forward = []
    model.forward = lambda *a, **k: (at_forward.append(len(made)), forward(*a, **k))[1]
    assert _eval_lm(model, batches(), DistInfo(), None, contextlib.nullcontext, shift=True)["eval_tokens"] == 28
    assert at_forward == [1, 2, 3, 4]


def test_start_fresh_moves_an_lra_result_aside(tmp_path):
    """A new `lra train` into the folder that diverges writes no result: the earlier run's stayed,
    and `lra report` read it as the new run's."""
    from transnormer.train.loop import start_fresh

    for name in ("metrics.jsonl", "lra_result.json", "lra_result.md"):
        (tmp_path / name).write_text("{}")
    start_fresh(tmp_path, log=lambda *a: None)
    (aside,) = (tmp_path / "checkpoints").glob("earlier-run-*")
    assert sorted(p.name for p in aside.iterdir()) == ["lra_result.json", "lra_result.md", "metrics.jsonl"]
    assert not (tmp_path / "lra_result.json").exists()


def test_a_resumed_classifier_refuses_data_whose_classes_differ(tmp_path):
    """Rebuilt from its preset, a resumed classifier had taken any label set: data whose labels sort
    the other way trained on with its classes swapped."""
    rows = [("good fine great", "pos"), ("bad awful poor", "neg")] * 12

    def write(labels):
        for split in ("train", "dev"):
            (tmp_path / "data" / f"{split}.tsv").write_text(
                "sentence\tlabel\n" + "".join(f"{t}\t{labels.get(y, y)}\n" for t, y in rows))

    (tmp_path / "data").mkdir()
    write({})
    cfg = TrainConfig(task="cls", preset="t2-roberta-tiny", data=str(tmp_path / "data"), vocab_size=300, seq_len=16,
                      batch_size=4, max_steps=3, save_every=1, out_dir=str(tmp_path / "run"), progress=False,
                      cache_dir=str(tmp_path / "cache"))
    assert train(replace(cfg, stop_after=1)) == {"stopped_at": 1}
    write({"neg": "x_other", "pos": "a_other"})
    with pytest.raises(ValueError, match=r"the model's classes are \['neg', 'pos'\]"):
        train(replace(cfg, resume=True))


@pytest.mark.parametrize("task", ["cls", "lra"])
def test_a_resume_refuses_a_training_split_changed_since_the_checkpoint(tmp_path, task):
    """A classifier (or LRA) run resumed over edited texts (the tokenizer trained again on them: every
    id another word's) or regenerated data had trained on without a word; the LM runs refused theirs.
    The data state now carries the split's fingerprint, checked before the weights (other data can
    mean another vocabulary, which the weights had reported as a raw size mismatch)."""
    from transnormer.data.lra import prepare

    if task == "cls":
        rows = [("good fine great movie", "pos"), ("bad awful poor film", "neg")] * 12
        (tmp_path / "data").mkdir()

        def write(edit):
            for split in ("train", "dev"):
                (tmp_path / "data" / f"{split}.tsv").write_text(
                    "sentence\tlabel\n" + "".join(f"{edit(t)}\t{y}\n" for t, y in rows))

        write(lambda t: t)
        cfg = TrainConfig(task="cls", preset="t2-roberta-tiny", data=str(tmp_path / "data"), vocab_size=300,
                          seq_len=16, batch_size=4, max_steps=3, save_every=1, out_dir=str(tmp_path / "run"),
                          progress=False, cache_dir=str(tmp_path / "cache"))
        def change():  # the same rows and labels, every word edited
            write(lambda t: " ".join(w[::-1] + "q" for w in t.split()))
    else:
        settings = dict(n_train=16, n_val=4, n_test=4, min_length=5, max_length=40)
        prepare("listops", tmp_path / "lra", seed=0, **settings)
        cfg = TrainConfig(task="cls", preset="t2-lra-listops-tiny", data=f"lra:listops:{tmp_path / 'lra'}",
                          seq_len=40, batch_size=4, max_steps=3, save_every=1, out_dir=str(tmp_path / "run"),
                          progress=False, cache_dir=str(tmp_path / "cache"))
        def change():  # regenerated with another seed: the same counts, other trees
            import shutil

            shutil.rmtree(tmp_path / "lra")
            prepare("listops", tmp_path / "lra", seed=1, **settings)
    assert train(replace(cfg, stop_after=1)) == {"stopped_at": 1}
    change()
    with pytest.raises(ValueError, match="the training split is not the one the run was saved with"):
        train(replace(cfg, resume=True))


def test_weights_of_another_shape_are_a_checkpoint_error(tmp_path):
    """(a raw RuntimeError before, where missing or unexpected keys were a CheckpointError)"""
    from transnormer.models import TransNormerConfig, TransNormerForCausalLM
    from transnormer.train.checkpoint import load_model_weights

    def model(vocab):
        return TransNormerForCausalLM(TransNormerConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=1,
                                                        num_attention_heads=2, block_size=8, chunk_size=8))

    model(64).save_pretrained(tmp_path)
    load_model_weights(model(64), tmp_path)
    with pytest.raises(CheckpointError, match="(?s)does not match the model: .*size mismatch for model.embed_tokens.weight"):
        load_model_weights(model(80), tmp_path)


def test_ctrl_c_saves_the_step_and_resume_continues_exactly(corpus_dir, tmp_path, monkeypatch):
    """Without --save-every a Ctrl-C had left nothing to resume: the step in flight now finishes, is
    saved, and the same command with --resume continues as if never stopped. The evaluation due
    at that step (--eval-every 3) is made up on resume (it had been lost for good)."""
    import signal

    full = cfg_for(corpus_dir, tmp_path / "a", out_dir=str(tmp_path / "full"), eval_every=3)
    train(full)
    orig, calls = torch.optim.AdamW.step, []

    def step(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # mid-step, as a user's Ctrl-C lands
        return orig(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    part = cfg_for(corpus_dir, tmp_path / "b", out_dir=str(tmp_path / "part"), eval_every=3)
    # as in a terminal (a background job, as CI may run, ignores SIGINT, and training leaves it so)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert train(part) == {"interrupted_at": 3}
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back
    finally:
        signal.signal(signal.SIGINT, before)
    monkeypatch.setattr(torch.optim.AdamW, "step", orig)
    assert not [r for r in read_metrics(Path(part.out_dir) / "metrics.jsonl") if r.get("kind") == "eval"]
    # a resume killed before its next checkpoint, after making the evaluation up: the next resume
    # makes it up again, from the same checkpoint, and its record had then been logged twice
    assert train(replace(part, resume=True, stop_after=4)) == {"stopped_at": 4}
    train(replace(part, resume=True))
    assert train_losses(part.out_dir) == pytest.approx(train_losses(full.out_dir), rel=0, abs=1e-6)

    def evals(run):
        return [(r["step"], r["loss"]) for r in read_metrics(Path(run.out_dir) / "metrics.jsonl") if r.get("kind") == "eval"]

    assert [s for s, _ in evals(part)] == [s for s, _ in evals(full)] == [3, 6]
    assert [x for _, x in evals(part)] == pytest.approx([x for _, x in evals(full)], rel=0, abs=1e-6)


def test_a_resumed_run_hides_the_abandoned_runs_tensorboard_events(corpus_dir, tmp_path, monkeypatch):
    """metrics.jsonl is cut back to the checkpoint on resume; the TensorBoard mirror kept the steps
    the abandoned run logged after it, so they showed twice. It now purges from the resumed step on."""
    import types

    made = []

    class Writer:  # TensorBoard is optional (not installed here): the writer's arguments are what matter
        def __init__(self, logdir, purge_step=None):
            made.append(purge_step)

        def add_scalar(self, *a):
            pass

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    cfg = cfg_for(corpus_dir, tmp_path, max_steps=4, save_every=2)
    train(replace(cfg, stop_after=3))  # a kill after step 3: the checkpoint is step 2's
    train(replace(cfg, resume=True))
    assert made == [None, 3]


def test_commands_that_train_stop_at_an_interrupted_run(corpus_dir, tmp_path, monkeypatch, capsys):
    """lra train had evaluated and then crashed on the interrupted run's summary, analyze ablation
    had gone on to the next configuration and written a cut curve up, compare had started the next
    preset: each now stops with exit status 130, writing no result."""
    import transnormer.train.compare as compare_mod
    import transnormer.train.loop as loop
    from transnormer.cli import main
    from transnormer.data.lra import prepare

    monkeypatch.setattr(loop, "train", lambda cfg: {"interrupted_at": 2})
    monkeypatch.setattr(compare_mod, "_train_isolated", lambda cfg: {"interrupted_at": 2})
    prepare("listops", tmp_path / "lra", seed=0, n_train=8, n_val=4, n_test=4, min_length=5, max_length=40)
    assert main(["lra", "train", "listops", "--root", str(tmp_path / "lra"), "--preset", "t2-lra-listops-tiny",
                 "--max-steps", "4", "--out", str(tmp_path / "lrarun")]) == 130
    assert "--resume continues" in capsys.readouterr().err and not (tmp_path / "lrarun" / "lra_result.json").exists()
    assert main(["analyze", "ablation", "--base", "t2-lm-tiny", "--data", str(corpus_dir), "--budget", "2s",
                 "--out", str(tmp_path / "abl")]) == 130
    assert not (tmp_path / "abl" / "ablation.json").exists()
    assert main(["compare", "--presets", "t2-lm-tiny,vanilla-lm-tiny", "--data", str(corpus_dir), "--max-steps", "4",
                 "--out", str(tmp_path / "cmp")]) == 130
    assert not (tmp_path / "cmp" / "comparison.md").exists()


def test_cls_pads_with_eos_when_the_tokenizer_has_no_pad_token(tmp_path, monkeypatch):
    # a GPT-2-style tokenizer (no pad token) had failed: "pass an explicit pad_id", which no flag reaches
    from transnormer.train import tasks

    rng = random.Random(4)
    lines = ["sentence\tlabel"] + [f"{' '.join(rng.choice(WORDS) for _ in range(rng.choice((2, 9))))}\t{i % 2}"
                                   for i in range(16)]
    (tmp_path / "train.tsv").write_text("\n".join(lines) + "\n")
    real = tasks.get_tokenizer

    class NoPad:
        def __init__(self, tok):
            self._tok = tok

        def __getattr__(self, name):
            return None if name == "pad_id" else getattr(self._tok, name)

    monkeypatch.setattr(tasks, "get_tokenizer", lambda *a: NoPad(real(*a)))
    cfg = TrainConfig(task="cls", preset="t2-roberta-tiny", data=str(tmp_path / "train.tsv"), vocab_size=300,
                      seq_len=16, batch_size=8, max_steps=1, cache_dir=str(tmp_path / "cache"))
    data = tasks.build_task_data(cfg, DistInfo(), contextlib.nullcontext)
    batch = next(data.train)
    pads = batch["input_ids"][~batch["attention_mask"].bool()]
    assert pads.numel() and bool((pads == data.tokenizer.eos_id).all())


def test_a_second_run_in_the_same_out_dir_is_refused(corpus_dir, tmp_path, monkeypatch):
    # it had moved the first run's files aside and deleted the checkpoint that run was writing
    import transnormer.train.loop as loop

    cfg = cfg_for(corpus_dir, tmp_path, max_steps=2)
    seen = []

    def inner(c):  # while this run holds the folder, a second one starts there
        # (the same folder spelled another way, and with another cache: keyed in the cache, the lock had
        # let two runs share a folder)
        other = replace(c, out_dir=c.out_dir + "/../run", cache_dir=str(tmp_path / "another-cache"))
        with pytest.raises(ValueError, match=rf"out_dir '{re.escape(other.out_dir)}' is in use by another "
                                             rf"process \(pid {os.getpid()}\)"):
            loop.train(other)
        seen.append(c.out_dir)
        return {"steps": 0}

    monkeypatch.setattr(loop, "_train", inner)
    assert loop.train(cfg) == {"steps": 0} and seen == [cfg.out_dir]
    assert loop.train(cfg) == {"steps": 0} and len(seen) == 2  # released: the next run there goes ahead
    (tmp_path / "a-file").write_text("")  # a folder that cannot be made: unlocked here, named by _train
    monkeypatch.setattr(loop, "_train", lambda c: {"steps": 0})
    assert loop.train(replace(cfg, out_dir=str(tmp_path / "a-file" / "run"))) == {"steps": 0}


def test_a_full_disk_is_named_and_keeps_the_last_checkpoint(tmp_path):
    """A checkpoint write that hits a size limit (RLIMIT_FSIZE, as a full disk or quota would) raises
    an OSError naming the checkpoint and the cause; it had been safetensors' Rust IoError or torch's
    "PytorchStreamWriter failed", with no path. The earlier checkpoint stays whole."""
    import errno
    import resource

    from transnormer.presets import build_model
    from transnormer.train.checkpoint import list_checkpoints, save_checkpoint

    model = build_model("t2-lm-tiny", vocab_size=2000, hidden_size=32, num_attention_heads=2, num_hidden_layers=1)
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, model, {"step": 1})
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))  # the weights are ~300 KB
    try:
        with pytest.raises(OSError, match=r"a file size limit \(ulimit -f\) was reached writing checkpoint "
                                          r"step-00000002") as err:
            save_checkpoint(root, 2, model, {"step": 2})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert err.value.errno == errno.EFBIG and err.value.filename == str(root)
    assert [p.name for p in list_checkpoints(root)] == ["step-00000001"]
    verify_checkpoint(root / "step-00000001")


def test_out_of_space_reads_every_writers_words():
    from transnormer._files import out_of_space

    assert out_of_space(OSError(28, "No space left on device"))
    assert out_of_space(RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                                     'space left on device" })'))
    assert out_of_space(RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0: "
                                     "PytorchStreamWriter failed writing file data/0: file write failed"))
    try:
        try:
            raise OSError(122, "Disk quota exceeded")
        except OSError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert out_of_space(outer)
    assert not out_of_space(OSError(13, "Permission denied")) and not out_of_space(ValueError("bad"))


def test_a_resume_refuses_an_edited_config_file(corpus_dir, tmp_path):
    # the same --config path counts as unchanged; the model was rebuilt from the file as it is now, and an
    # edit the weights still fitted (activation, dropout) trained on as another model
    from transnormer.presets import get_config

    conf = tmp_path / "model.json"
    get_config("t2-lm-tiny", vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               block_size=8, chunk_size=8).to_json_file(conf)
    kw = {"preset": None, "config_file": str(conf), "overrides": {}, "save_every": 1, "max_steps": 3}
    assert train(cfg_for(corpus_dir, tmp_path, stop_after=1, **kw)) == {"stopped_at": 1}
    edited = json.loads(conf.read_text())
    conf.write_text(json.dumps({**edited, "ffn_act": "relu", "dropout": 0.5}))
    with pytest.raises(ValueError, match=r"resume: the model differs from the one saved in .*model dropout: 0.1 -> "
                                         r"0.5; model ffn_act: 'silu' -> 'relu'"):
        train(cfg_for(corpus_dir, tmp_path, resume=True, **kw))
    conf.write_text(json.dumps(edited))
    assert train(cfg_for(corpus_dir, tmp_path, resume=True, **kw))["steps"] == 3
