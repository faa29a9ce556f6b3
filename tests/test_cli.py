"""The command line end to end on a tiny fixture corpus: train → generate / eval, analyze, errors."""

import json
import random

import pytest

from transnormer.cli import main

WORDS = "def return value list dict the of a an if else for while import class".split()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    rng = random.Random(0)
    for split, n in (("train", 300), ("valid", 40), ("test", 40)):
        docs = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(n)]
        (root / f"{split}.txt").write_text("\n\n".join(docs))
    out = root / "run"
    rc = main(["train", "--preset", "t2-lm-tiny", "--data", str(root), "--vocab-size", "300", "--seq-len", "32",
               "--batch-size", "4", "--max-steps", "3", "--out", str(out), "--no-progress", "--eval-batches", "2",
               "--cache-dir", str(root / "cache"), "--set", "num_hidden_layers=2", "--set", "hidden_size=32",
               "--set", "num_attention_heads=2"])
    assert rc == 0
    return root, out


def test_train_writes_run(run_dir):
    _, out = run_dir
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["eval"]["ppl"] > 1
    assert (out / "metrics.jsonl").exists() and (out / "checkpoints" / "latest").exists()


def test_generate_streams(run_dir, capsys):
    _, out = run_dir
    assert main(["generate", "--model", str(out), "--prompt", "def return", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("def return")


def test_eval_with_stride(run_dir, capsys):
    root, out = run_dir
    assert main(["eval", "--model", str(out), "--data", str(root), "--seq-len", "32", "--stride", "16",
                 "--max-batches", "2", "--cache-dir", str(root / "cache")]) == 0
    printed = capsys.readouterr().out
    res = json.loads(printed[printed.find("{"):])
    assert res["stride"] == 16 and res["ppl"] > 1 and res["eval_tokens"] > 0


def test_errors_are_clear(tmp_path, capsys):
    assert main(["train", "--preset", "t9-lm", "--max-steps", "1", "--out", str(tmp_path), "--no-progress",
                 "--data", str(tmp_path / "missing.txt")]) == 2
    assert "error" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "no model" in capsys.readouterr().err


def test_analyze_gradient_bound(tmp_path, capsys):
    assert main(["analyze", "gradient-bound", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "gradient_bound.json").read_text())
    assert data["summary"]["norm_attention_within_bound"]


@pytest.mark.parametrize("argv,match", [
    (["analyze", "dilution", "--models", " , "], "no model given"),
    (["analyze", "dilution", "--models", "t2-lm-tiny", "--seq-len", "0"], "--seq-len must be >= 1"),
    (["analyze", "dilution", "--models", "t2-lm-tiny", "--samples", "-1"], "--samples must be >= 1"),
    (["analyze", "grad-stats", "--metrics", "{tmp}"], "Is a directory"),
    (["analyze", "grad-stats", "--metrics", "{tmp}/empty.jsonl"], "no record has both"),
])
def test_analyze_bad_input_is_one_clear_line(tmp_path, capsys, argv, match):
    (tmp_path / "empty.jsonl").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv + ["--out", str(tmp_path / "out")]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("flags,match", [(["--temperature", "-1"], "--temperature must be >= 0"),
                                         (["--top-p", "1.5"], "--top-p must be in"),
                                         (["--top-p", "0"], "--top-p must be in")])
def test_generate_refuses_out_of_range_sampling(run_dir, capsys, flags, match):
    _, out = run_dir
    assert main(["generate", "--model", str(out), "--prompt", "def", "--max-new-tokens", "2", *flags]) == 2
    assert match in capsys.readouterr().err
