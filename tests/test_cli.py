"""The command line end to end on a tiny fixture corpus: train → generate / eval, analyze, errors."""

import json
import os
import random
from pathlib import Path

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


def test_generate_into_a_reader_that_stops_early_ends_quietly(run_dir, tmp_path):
    # `transnormer generate ... | head` had printed "error: [Errno 32] Broken pipe" and returned 2
    import subprocess
    import sys

    root, out = run_dir
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # (a pipe's stdout, as usual)
    commands = [["generate", "--model", str(out), "--prompt", "def", "--max-new-tokens", "50", "--seed", "0"],
                ["generate", "--model", str(out), "--prompt", "def", "--max-new-tokens", "5", "--no-stream"],
                # a small result, buffered until exit, had ended in "Exception ignored ... BrokenPipeError"
                # (status 120); its --out file, written after the print, had been lost
                ["eval", "--model", str(out), "--data", str(root), "--seq-len", "32", "--max-batches", "1",
                 "--cache-dir", str(root / "cache"), "--out", str(tmp_path / "piped_eval.json")]]
    # with stdout unbuffered (PYTHONUNBUFFERED) nothing is left to flush: that had been an error, status 2
    for argv, env in [(a, e) for a in commands for e in (buffered, {**buffered, "PYTHONUNBUFFERED": "1"})]:
        proc = subprocess.Popen([sys.executable, "-m", "transnormer.cli", *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env={**env, "TRANSNORMER_THREADS": "1"})
        proc.stdout.close()  # the reader goes away before the first word (as head would after its lines)
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 141, (argv, err)
        assert "Broken pipe" not in err and "Traceback" not in err and "Exception ignored" not in err, err
    assert json.loads((tmp_path / "piped_eval.json").read_text())["ppl"] > 1


def test_a_broken_pipe_that_is_not_stdout_is_an_error(monkeypatch, capsys):
    # only stdout's reader going away is a quiet 141; another pipe breaking is reported
    import transnormer.cli as cli

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "cmd_eval", broken)
    parser = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser(), "eval", broken))
    assert cli.main(["eval", "--model", "m"]) == 2
    assert "transnormer eval: error: [Errno 32] Broken pipe" in capsys.readouterr().err


def _with_func(parser, command, func):
    for action in parser._subparsers._group_actions:
        action.choices[command].set_defaults(func=func)
    return parser


@pytest.mark.parametrize("command", [["train", "--preset", "t2-lm-tiny"], ["compare", "--presets", "t2-lm-tiny"],
                                     ["analyze", "ablation"]])
@pytest.mark.parametrize("value", ["100", "-5", "abc"])
def test_a_bpe_too_small_for_its_bytes_is_refused_by_the_flag(command, value, capsys):
    # it had been refused after start-up by the tokenizer, naming the field: "vocab_size must be >= 261"
    # (analyze ablation after writing its first arm's config)
    with pytest.raises(SystemExit) as e:
        main([*command, "--vocab-size", value])
    assert e.value.code == 2
    shown = value if value != "abc" else "'abc'"
    assert "argument --vocab-size: expected an integer >= 261 (the BPE's special tokens and 256 byte symbols), " \
           f"got {shown}" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["generate", "--model", "m", "--prompt", "x"], ["analyze", "gradient-bound"],
                                  ["lra", "prepare", "listops"]])
def test_seed_out_of_range_is_refused_by_name(argv, capsys):
    # generate had loaded the model, then failed with "Overflow when unpacking long long"
    with pytest.raises(SystemExit) as e:
        main([*argv, "--seed", str(2**70)])
    assert e.value.code == 2
    assert "argument --seed: expected an integer seed in [0, 2**32), got 1180591620717411303424" in capsys.readouterr().err


def test_generate_samples_from_every_token_unless_told_otherwise(run_dir, monkeypatch):
    """transformers fills in top_k = 50 where a call sets none: --top-p 1 had still cut sampling to
    50 tokens. generate passes top_k (default 0: no cut); --top-k sets it."""
    from transformers import GenerationMixin

    from transnormer.cli import generate_text

    _, out = run_dir
    seen = []
    real = GenerationMixin.generate
    monkeypatch.setattr(GenerationMixin, "generate",
                        lambda self, input_ids, **kw: seen.append(kw.get("top_k")) or real(self, input_ids, **kw))
    generate_text(out, "def", max_new_tokens=2, stream=False, temperature=0.8, top_p=1.0)
    generate_text(out, "def", max_new_tokens=2, stream=False, temperature=0.8, top_k=5)
    generate_text(out, "def", max_new_tokens=2, stream=False, temperature=0.0)  # greedy: no sampling knobs
    assert seen == [0, 5, None]


def test_generate_starts_the_prompt_as_training_starts_a_document(run_dir, monkeypatch):
    """Training reads documents each followed by EOS, so a document starts after EOS; <s> never
    occurs there (starting from it cost a trained model ~3 nats on the first token)."""
    from transformers import GenerationMixin

    from transnormer.cli import generate_text, resolve_model_dir
    from transnormer.train.checkpoint import model_tokenizer

    _, out = run_dir
    seen = []
    real = GenerationMixin.generate

    def spy(self, input_ids, **kw):
        seen.append(input_ids[0].tolist())
        return real(self, input_ids, **kw)

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    generate_text(out, "def return", max_new_tokens=2, stream=False)
    tok = model_tokenizer(resolve_model_dir(out))
    assert seen == [[tok.eos_id] + tok.encode("def return")]


def test_eval_finds_a_tokenizer_beside_the_weights(run_dir, tmp_path, capsys):
    """A Hugging Face layout (tokenizer.json next to config.json), as generate reads it."""
    import shutil

    from transformers import AutoModelForCausalLM

    from transnormer.cli import resolve_model_dir

    root, out = run_dir
    hf, ckpt = tmp_path / "hf", resolve_model_dir(out)
    AutoModelForCausalLM.from_pretrained(ckpt).save_pretrained(hf)
    for f in (ckpt / "tokenizer").iterdir():
        shutil.copy(f, hf / f.name)
    assert main(["eval", "--model", str(hf), "--data", str(root), "--seq-len", "32", "--max-batches", "1",
                 "--cache-dir", str(root / "cache")]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.find("{"):])["eval_tokens"] > 0


def test_eval_splits_the_data_with_the_runs_data_seed(run_dir, tmp_path, capsys, monkeypatch):
    """valid/test carved out of train depend on the run's data_seed; eval had split with seed 0, so a
    run trained with data_seed=3 (Python API) was scored on documents it had trained on."""
    import shutil

    from transnormer.cli import resolve_model_dir
    from transnormer.train import tasks
    from transnormer.train.checkpoint import MANIFEST

    root, out = run_dir
    plain = tmp_path / "plain"  # no file names a split: all three are carved by the seed
    plain.mkdir()
    (plain / "all.txt").write_text("\n\n".join((root / f"{s}.txt").read_text() for s in ("train", "valid")))
    model = tmp_path / "model"
    shutil.copytree(resolve_model_dir(out), model)
    for f in ("trainer_state.pt", MANIFEST):  # a model folder: its run's train_config.json records the seed
        (model / f).unlink()
    (model / "train_config.json").write_text(json.dumps({"data": str(plain), "data_seed": 3}))
    seeds = []
    real = tasks.load_corpus
    monkeypatch.setattr(tasks, "load_corpus", lambda spec, **kw: seeds.append(kw["seed"]) or real(spec, **kw))
    for data, seed in ((str(plain), 3), (str(plain) + "/../plain", 3), (str(root), 0)):  # another corpus: 0
        assert main(["eval", "--model", str(model), "--data", data, "--seq-len", "32", "--max-batches", "1",
                     "--cache-dir", str(root / "cache")]) == 0
        printed = capsys.readouterr().out
        assert json.loads(printed[printed.find("{"):])["data_seed"] == seed and seeds[-1] == seed


def test_eval_with_stride(run_dir, capsys):
    root, out = run_dir
    assert main(["eval", "--model", str(out), "--data", str(root), "--seq-len", "32", "--stride", "16",
                 "--max-batches", "2", "--cache-dir", str(root / "cache")]) == 0
    printed = capsys.readouterr().out
    res = json.loads(printed[printed.find("{"):])
    assert res["stride"] == 16 and res["ppl"] > 1 and res["eval_tokens"] > 0


def test_eval_needs_no_train_split_of_one_batch(run_dir, capsys):
    """A batch of 1000 windows of 32 tokens: more than the train split holds (it made `eval` fail
    building the training windows it never reads); the evaluated split is scored in fewer rows."""
    root, out = run_dir
    assert main(["eval", "--model", str(out), "--data", str(root), "--seq-len", "32", "--batch-size", "1000",
                 "--split", "test", "--cache-dir", str(root / "cache")]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.find("{"):])["eval_tokens"] > 1000


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
    (["analyze", "grad-stats", "--metrics", "{tmp}"], "is a folder; give a file in it"),  # had been Errno 21
    (["analyze", "grad-stats", "--metrics", "{tmp}/nope.jsonl"], "no such file"),
    (["analyze", "dilution", "--models", "{tmp},{tmp}/"], "each model once"),  # one folder spelt two ways
    # read by nothing beside a tokenizer: had been accepted silently
    (["analyze", "dilution", "--models", "t2-lm-tiny", "--tokenizer", "{tmp}/tok", "--vocab-size", "300"],
     "leave --vocab-size out"),
    # beside a model folder the presets take its tokenizer: no BPE is trained (had been ignored silently)
    (["analyze", "dilution", "--models", "{tmp},t2-lm-tiny", "--vocab-size", "300"], "leave --vocab-size out"),
    (["analyze", "dilution", "--models", "{tmp}/nodir"], "no such folder"),  # had listed ~100 preset names
    (["analyze", "grad-stats", "--metrics", "{tmp}/empty.jsonl"], "no record has both"),
    # each of these had been found after the corpus and tokenizer, or not at all
    (["analyze", "dilution", "--models", "t2-lm-tiny,t2-lm-tiny"], "each model once"),
    (["analyze", "dilution", "--models", "bogus-preset", "--cache-dir", "{tmp}/cache"], "bogus-preset"),
    (["analyze", "dilution", "--models", "t2-lm-tiny", "--vocab-size", "0"], "--vocab-size must be >= 261"),
    (["analyze", "grad-stats", "--metrics", "{tmp}/mixer.jsonl", "--param-set", "all"],
     "records norms over mixer"),  # the report had named norms the file does not hold
    (["analyze", "ablation", "--budget", "bogus"], "budget (--budget) must look like"),  # had written its configs first
    (["analyze", "ablation", "--data", "{tmp}/nope.txt"], "nope.txt' does not exist"),  # so had this
])
def test_analyze_bad_input_is_one_clear_line(tmp_path, capsys, argv, match):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "mixer.jsonl").write_text('{"step": 1, "grad_norm": 1.0, "param_set": "mixer"}\n')
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv + ["--out", str(tmp_path / "out")]) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()  # nothing left behind


@pytest.mark.parametrize("flags,match", [(["--temperature", "-1"], "--temperature must be finite and >= 0"),
                                         (["--temperature", "inf"], "--temperature must be finite and >= 0"),
                                         (["--temperature", "1e-45"], "--temperature must be 0 (greedy) or at least"),
                                         (["--top-p", "1.5"], "--top-p must be in"),
                                         (["--top-p", "0"], "--top-p must be in"),
                                         (["--top-k", "-1"], "--top-k must be an int >= 0")])
def test_generate_refuses_out_of_range_sampling(run_dir, capsys, flags, match):
    _, out = run_dir
    assert main(["generate", "--model", str(out), "--prompt", "def", "--max-new-tokens", "2", *flags]) == 2
    assert match in capsys.readouterr().err


def _exit_code(argv) -> int:
    """main's return value, or the code of the SystemExit with which argparse refuses an argument."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("flags,match", [
    (["--max-batches", "0"], "argument --max-batches: expected an integer >= 1, got 0"),
    (["--max-batches", "-2"], "argument --max-batches: expected an integer >= 1, got -2"),
    (["--batch-size", "0"], "argument --batch-size: expected an integer >= 1, got 0"),
    (["--stride", "0"], "argument --stride: expected an integer >= 1, got 0"),
    (["--stride", "64"], "--stride must be at most --seq-len (32), got 64"),
    (["--task", "mlm", "--stride", "8"], "--stride applies to --task clm only"),
    (["--text-column", "0"], "apply to --task cls only"),
    (["--no-truncate"], "--skip-bad-rows and --no-truncate apply to --task cls only, not --task clm"),
    # an LM scored as a classifier had loaded a fresh random head and printed its accuracy, rc 0
    (["--task", "cls"], "is a TransNormerForCausalLM (trained with --task clm); --task cls needs a "
                        "*ForSequenceClassification model"),
])
def test_eval_refuses_flags_that_would_change_nothing(run_dir, capsys, flags, match):
    root, out = run_dir
    assert _exit_code(["eval", "--model", str(out), "--data", str(root), "--seq-len", "32",
                       "--cache-dir", str(root / "cache"), *flags]) == 2
    assert match in capsys.readouterr().err


def test_outputs_that_would_destroy_inputs_or_land_in_the_cwd_are_refused(run_dir, tmp_path, capsys):
    """eval --out had overwritten its --data file and a checkpoint's config.json (the model then
    unloadable); --out "" (an unset shell variable) wrote a run into the working folder; compare
    --preset X had been read as --presets X (abbreviation), running other models, rc 0; lra report
    --out had replaced a run's lra_result.json with the table."""
    import shutil

    from transnormer.cli import resolve_model_dir

    root, out = run_dir
    data = tmp_path / "corpus"
    shutil.copytree(root, data, ignore=shutil.ignore_patterns("cache"))
    before = (data / "valid.txt").read_text()
    model = resolve_model_dir(out)
    common = ["eval", "--model", str(out), "--data", str(data), "--seq-len", "32", "--max-batches", "1",
              "--cache-dir", str(root / "cache")]
    for target, what in ((data / "valid.txt", "in --data"), (model / "config.json", "in --model")):
        assert _exit_code([*common, "--out", str(target)]) == 2
        assert f"is {what}" in capsys.readouterr().err
    assert (data / "valid.txt").read_text() == before and resolve_model_dir(out) == model
    assert _exit_code(["train", "--max-steps", "1", "--out", ""]) == 2
    assert "--out: expected a path, got ''" in capsys.readouterr().err
    assert _exit_code(["compare", "--presets", "t2-lm-tiny", "--preset", "vanilla-lm-tiny", "--out", str(tmp_path / "c")]) == 2
    assert "unrecognized arguments: --preset" in capsys.readouterr().err
    result = tmp_path / "lra_result.json"
    result.write_text(json.dumps({"kind": "lra-result", "task": "listops", "preset": "t2-lra-listops-tiny",
                                  "data_provenance": "synthetic-fixture", "dataset_id": "x"}))
    text = result.read_text()
    for target in (result, result.with_suffix(".md")):
        assert _exit_code(["lra", "report", str(tmp_path), "--out", str(target)]) == 2
        assert "is one of the results read" in capsys.readouterr().err
    assert result.read_text() == text


def test_skip_bad_rows_and_pooling_of_a_fine_tune(tmp_path, capsys):
    # the error told CLI users to pass skip_bad_rows=True, which no flag reached; and --init-from refused
    # --set classifier_pooling, which the pretrained weights do not fix (the new head reads it)
    rng = random.Random(2)
    lines = ["sentence\tlabel"] + [f"{' '.join(rng.choice(WORDS) for _ in range(5))}\t{i % 2}" for i in range(24)]
    (tmp_path / "train.tsv").write_text("\n".join([*lines, "a stray\tdelimiter\t1"]) + "\n")
    argv = ["train", "--task", "cls", "--preset", "t2-roberta-tiny", "--data", str(tmp_path), "--vocab-size", "300",
            "--seq-len", "12", "--batch-size", "4", "--max-steps", "1", "--out", str(tmp_path / "run"), "--no-progress",
            "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 2 and "(--skip-bad-rows) skips such rows" in capsys.readouterr().err
    assert main([*argv, "--skip-bad-rows"]) == 0
    from transnormer.train.loop import TrainConfig

    TrainConfig(task="cls", preset=None, init_from=str(tmp_path / "run"), data=str(tmp_path),
                max_steps=1, overrides={"classifier_pooling": "last"}).check()


def test_cls_reading_flags_and_truncation_report(tmp_path, capsys, monkeypatch):
    """--header no keeps a first row that reads like names ("text", "maybe"), --drop-label skips
    SNLI-style "-" rows, and examples cut to --seq-len are reported (they had been cut silently)."""
    rng = random.Random(5)

    def rows(n, first=None):
        body = [f"{' '.join(rng.choice(WORDS) for _ in range(rng.choice((3, 20))))}\t{rng.choice(['pos', 'neg', '-'])}"
                for _ in range(n)]
        return "\n".join(([first] if first else []) + body) + "\n"

    (tmp_path / "train.tsv").write_text(rows(30, first="text\tmaybe"))
    (tmp_path / "dev.tsv").write_text(rows(12))
    out = tmp_path / "run"
    assert main(["train", "--task", "cls", "--preset", "t2-roberta-tiny", "--data", str(tmp_path), "--vocab-size",
                 "300", "--seq-len", "12", "--batch-size", "4", "--max-steps", "1", "--out", str(out),
                 "--no-progress", "--cache-dir", str(tmp_path / "cache"), "--text-column", "0", "--label-column", "1",
                 "--header", "no", "--drop-label", "-"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    from transnormer.cli import resolve_model_dir

    labels = json.loads((resolve_model_dir(out) / "config.json").read_text())["id2label"]
    assert sorted(labels.values()) == ["maybe", "neg", "pos"]
    assert summary["truncated"]["train"] > 0 and f"cls: truncated {summary['truncated']['train']} of " in printed
    assert summary["eval"]["truncated"] == summary["truncated"]["valid"] > 0  # 20 words > 12 tokens
    assert summary["eval"]["n"] == sum(1 for line in (tmp_path / "dev.tsv").read_text().splitlines()
                                       if not line.endswith("\t-"))
    # eval: stdout is the JSON result alone (the truncation note had come first), the note on stderr
    assert main(["eval", "--task", "cls", "--model", str(out), "--data", str(tmp_path), "--seq-len", "12",
                 "--cache-dir", str(tmp_path / "cache"), "--text-column", "0", "--label-column", "1",
                 "--header", "no", "--drop-label", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["n"] == summary["eval"]["n"] and "cls: truncated" in captured.err
    # without the flags, eval reads the run's data as the run did (it had kept the "-" rows, labels
    # the model does not have, and guessed the header)
    assert main(["eval", "--task", "cls", "--model", str(out), "--data", str(tmp_path), "--seq-len", "12",
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["n"] == summary["eval"]["n"] and res["loss"] == pytest.approx(summary["eval"]["loss"], rel=1e-6)
    assert res["read"] == {"text_column": 0, "label_column": 1, "has_header": False, "drop_labels": ["-"]}
    # the note names --no-truncate, which eval did not have; and another --tokenizer had been taken
    argv = ["eval", "--task", "cls", "--model", str(out), "--data", str(tmp_path), "--seq-len", "12", "--cache-dir",
            str(tmp_path / "cache"), "--text-column", "0", "--label-column", "1", "--header", "no", "--drop-label", "-"]
    assert main([*argv, "--no-truncate"]) == 2
    assert "tokens exceed max_length=12" in capsys.readouterr().err
    # a run trained with --no-truncate: eval follows it, and --truncate undoes it (a store_true flag
    # could only turn it on)
    import transnormer.cli as cli

    real = cli._run_config_for
    monkeypatch.setattr(cli, "_run_config_for", lambda *a: {**real(*a), "no_truncate": True})
    assert main(argv) == 2 and "eval of a run trained with it: --truncate" in capsys.readouterr().err
    assert main([*argv, "--truncate"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(cli, "_run_config_for", real)
    from transnormer.data import train_bpe

    train_bpe([(tmp_path / "dev.tsv").read_text()], vocab_size=270).save(tmp_path / "other")
    assert main([*argv, "--tokenizer", str(tmp_path / "other")]) == 2
    assert "is not the tokenizer the model in" in capsys.readouterr().err


def test_train_refuses_cls_flags_for_clm(run_dir, capsys):
    root, out = run_dir
    assert main(["train", "--data", str(root), "--max-steps", "1", "--out", str(out.parent / "x"),
                 "--no-progress", "--no-truncate"]) == 2
    assert "apply to --task cls only" in capsys.readouterr().err


def test_a_diverged_run_exits_non_zero(run_dir, tmp_path, capsys, monkeypatch):
    import torch

    root, _ = run_dir
    orig = torch.optim.AdamW.step

    def step(self, *a, **k):
        out = orig(self, *a, **k)
        with torch.no_grad():
            self.param_groups[0]["params"][0].fill_(float("nan"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    assert main(["train", "--preset", "t2-lm-tiny", "--data", str(root), "--vocab-size", "300", "--seq-len", "32",
                 "--batch-size", "4", "--max-steps", "4", "--out", str(tmp_path / "run"), "--no-progress",
                 "--cache-dir", str(root / "cache"), "--set", "num_hidden_layers=2", "--set", "hidden_size=32",
                 "--set", "num_attention_heads=2"]) == 1
    assert "the run diverged at step 2" in capsys.readouterr().err


def test_column_indices_of_a_headerless_cls_file(tmp_path, capsys):
    """All-digit --text-column / --label-column are indices: as strings, a first row labelled "0"
    or "1" had matched them as column names and been taken for a header."""
    from transnormer.cli import build_parser

    args = build_parser().parse_args(["train", "--task", "cls", "--text-column", "0", "--label-column", "label"])
    assert args.text_column == 0 and args.label_column == "label"
    rng = random.Random(4)
    for split, n in (("train", 24), ("dev", 9)):
        rows = [f"{' '.join(rng.choice(WORDS) for _ in range(6))}\t{i % 2}" for i in range(n)]
        (tmp_path / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "run"
    assert main(["train", "--task", "cls", "--preset", "t2-roberta-tiny", "--data", str(tmp_path), "--vocab-size",
                 "300", "--seq-len", "16", "--batch-size", "4", "--max-steps", "1", "--out", str(out),
                 "--no-progress", "--cache-dir", str(tmp_path / "cache"), "--text-column", "0",
                 "--label-column", "1"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval"]["n"] == 9  # every dev row, the first too
    # tokens counts 4 x 16 positions; the 4 examples hold fewer (they had been counted as tokens/s too)
    assert summary["tokens"] == 64 and 4 * 6 <= summary["real_tokens"] < 64
    # evaluating needs no train split of one batch: a batch of 30 over the 9 dev rows, 24 train rows
    capsys.readouterr()
    assert main(["eval", "--task", "cls", "--model", str(out), "--data", str(tmp_path), "--seq-len", "16",
                 "--batch-size", "30", "--cache-dir", str(tmp_path / "cache"), "--text-column", "0",
                 "--label-column", "1"]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.find("{"):])["n"] == 9
    # the checkpoint names its classes, and data whose classes differ is refused, not scored by index
    from transnormer.cli import resolve_model_dir

    assert json.loads((resolve_model_dir(out) / "config.json").read_text())["id2label"] == {"0": "0", "1": "1"}
    other = tmp_path / "other"
    other.mkdir()
    (other / "train.tsv").write_text("".join(f"{w} words\t{'neg' if i % 2 else 'pos'}\n"
                                             for i, w in enumerate(WORDS[:10])))
    assert main(["eval", "--task", "cls", "--model", str(out), "--data", str(other), "--split", "train",
                 "--seq-len", "16", "--cache-dir", str(tmp_path / "cache"), "--text-column", "0",
                 "--label-column", "1"]) == 2
    assert "line 1: label 'pos' is not in the label set ['0', '1'] (the model's classes, its config.id2label)" in \
        capsys.readouterr().err
    # The data's labels are read against the model's classes, and only the split evaluated is read:
    # a folder with a dev file alone, or a train file with one class of the two, had been refused
    # (no train file; a label set built from the train split). The scores are the same.
    def scores(folder):
        capsys.readouterr()
        assert main(["eval", "--task", "cls", "--model", str(out), "--data", str(folder), "--seq-len", "16",
                     "--batch-size", "30", "--cache-dir", str(tmp_path / "cache"), "--text-column", "0",
                     "--label-column", "1"]) == 0, capsys.readouterr().err
        printed = capsys.readouterr().out
        return json.loads(printed[printed.find("{"):])

    full = scores(tmp_path)
    dev_only, one_class = tmp_path / "dev_only", tmp_path / "one_class"
    for folder in (dev_only, one_class):
        folder.mkdir()
        (folder / "dev.tsv").write_text((tmp_path / "dev.tsv").read_text())
    (one_class / "train.tsv").write_text("".join(f"{w} words\t1\n" for w in WORDS[:5]))
    for folder in (dev_only, one_class):
        res = scores(folder)
        assert res["n"] == 9 and res["accuracy"] == full["accuracy"] and res["eval_split"] == "valid"
    capsys.readouterr()
    assert main(["eval", "--task", "cls", "--model", str(out), "--data", str(dev_only), "--split", "test",
                 "--seq-len", "16", "--cache-dir", str(tmp_path / "cache")]) == 2
    assert "--split test: no such split in --data" in capsys.readouterr().err
    capsys.readouterr()
    assert main(["eval", "--task", "cls", "--model", str(out), "--data", str(dev_only / "dev.tsv"), "--seq-len", "16",
                 "--cache-dir", str(tmp_path / "cache")]) == 2
    assert "(a single file is read as the train split: --split train)" in capsys.readouterr().err


def test_a_regression_task_trains_evaluates_and_compares_by_correlation(tmp_path, capsys):
    """STS-B (sentence pairs scored 0-5) trains a one-output head by MSE, and train, eval and compare
    report Pearson and Spearman; eval reads the dev split alone, against the model's regression."""
    from transnormer.train.compare import comparison_table
    from transnormer.train.loop import TrainConfig

    rng = random.Random(5)
    head = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    for split, n in (("train", 40), ("dev", 12)):
        rows = [f"{i}\tmain\tf\t2012\t{i}\tnone\tnone\t{' '.join(rng.choice(WORDS) for _ in range(5))}\t"
                f"{' '.join(rng.choice(WORDS) for _ in range(5))}\t{rng.randint(0, 25) / 5:.3f}" for i in range(n)]
        (tmp_path / f"{split}.tsv").write_text(head + "\n".join(rows) + "\n")
    out = tmp_path / "run"
    assert main(["train", "--task", "cls", "--preset", "t2-roberta-tiny", "--data", str(tmp_path), "--vocab-size",
                 "300", "--seq-len", "24", "--batch-size", "4", "--max-steps", "2", "--out", str(out),
                 "--no-progress", "--cache-dir", str(tmp_path / "cache")]) == 0
    trained = json.loads((out / "summary.json").read_text())["eval"]
    assert trained["n"] == 12 and {"pearson", "spearman", "mse"} <= set(trained)

    dev_only = tmp_path / "dev_only"
    dev_only.mkdir()
    (dev_only / "dev.tsv").write_text((tmp_path / "dev.tsv").read_text())
    capsys.readouterr()
    assert main(["eval", "--task", "cls", "--model", str(out), "--data", str(dev_only), "--seq-len", "24",
                 "--cache-dir", str(tmp_path / "cache")]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    res = json.loads(printed[printed.find("{"):])
    for key in ("pearson", "spearman", "mse", "loss", "n"):
        assert res[key] == pytest.approx(trained[key], rel=1e-5), key
    # a one-output model in HF's default form (no problem_type: regression by HF's rule) is read the same way
    import shutil

    from transnormer.cli import resolve_model_dir

    hf_form = tmp_path / "hf_form"
    shutil.copytree(resolve_model_dir(out), hf_form)
    (hf_form / "manifest.json").unlink(missing_ok=True)
    config = json.loads((hf_form / "config.json").read_text())
    del config["problem_type"]
    (hf_form / "config.json").write_text(json.dumps(config))
    assert main(["eval", "--task", "cls", "--model", str(hf_form), "--data", str(dev_only), "--seq-len", "24",
                 "--cache-dir", str(tmp_path / "cache")]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.find("{"):])["pearson"] == pytest.approx(trained["pearson"], rel=1e-5)

    cfg = TrainConfig(task="cls", preset="t2-roberta-tiny", data=str(tmp_path), max_steps=2)
    table = comparison_table([{"name": "t2-roberta-tiny", "params": 1e6, "steps": 2, "tokens": 192,
                               "tokens_per_s": 1.0, "peak_mem_mb": 1.0, "eval": trained}], cfg)
    assert "| valid loss (MSE) | Pearson | Spearman |" in table and f"{trained['pearson']:.4f}" in table


def test_dilution_refuses_models_with_different_tokenizers(run_dir, tmp_path, capsys):
    """One text is tokenized once for all models: a model trained with another tokenizer would read
    wrong ids (or ids past its embedding)."""
    import shutil

    from transnormer.cli import resolve_model_dir
    from transnormer.data import train_bpe

    root, out = run_dir
    other = tmp_path / "other"
    shutil.copytree(resolve_model_dir(out), other)
    shutil.rmtree(other / "tokenizer")
    (other / "manifest.json").unlink()  # a model directory of its own, not a (now altered) checkpoint
    train_bpe([(root / "train.txt").read_text()], vocab_size=280).save(other / "tokenizer")
    assert main(["analyze", "dilution", "--models", f"{out},{other}", "--data", str(root), "--seq-len", "32",
                 "--samples", "1", "--cache-dir", str(root / "cache"), "--out", str(tmp_path / "dil")]) == 2
    assert "were trained with different tokenizers" in capsys.readouterr().err


def test_only_rank_zero_prints_the_train_summary(run_dir, tmp_path, capsys, monkeypatch):
    # under torchrun every rank printed a summary, and the other ranks' lacked rank 0's metrics
    import transnormer.train as train_pkg

    root, _ = run_dir
    monkeypatch.setattr(train_pkg, "train", lambda cfg: {"steps": 1, "diverged_at": 1})
    argv = ["train", "--preset", "t2-lm-tiny", "--data", str(root), "--max-steps", "1", "--out", str(tmp_path / "r")]
    monkeypatch.setenv("RANK", "1")
    assert main(argv) == 1  # every rank still fails a diverged run
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(argv) == 1
    out = capsys.readouterr()
    assert '"steps": 1' in out.out and "diverged at step 1" in out.err


def test_compare_and_generate_refuse_bad_input_up_front(run_dir, tmp_path, capsys):
    root, out = run_dir
    from transnormer.presets import build_model

    build_model("t2-roberta-tiny", task="cls", num_labels=2).save_pretrained(tmp_path / "clsm")
    assert main(["generate", "--model", str(tmp_path / "clsm"), "--prompt", "x"]) == 2  # had failed inside HF
    assert "(trained with --task cls); generate needs a *ForCausalLM model" in capsys.readouterr().err
    common = ["--data", str(root), "--seq-len", "32", "--out", str(tmp_path / "cmp")]
    assert main(["compare", "--presets", ",", "--max-steps", "1", *common]) == 2
    assert "--presets: give one or more" in capsys.readouterr().err
    assert main(["compare", "--presets", "t2-lm-tiny", *common]) == 2  # no steps or budget
    assert "give max_steps (--max-steps) or budget (--budget" in capsys.readouterr().err
    assert main(["compare", "--presets", "t2-roberta-tiny", "--task", "mlm", "--sample", "--max-steps", "1",
                 *common]) == 2
    assert "--sample generates text and needs --task clm" in capsys.readouterr().err
    assert main(["train", "--tokenizer", str(out), "--vocab-size", "500", "--max-steps", "1", *common]) == 2
    assert "--vocab-size sizes the BPE trained on the data" in capsys.readouterr().err
    assert main(["compare", "--presets", "t2-lm-tiny,t2-roberta-tiny", "--max-steps", "1", *common]) == 2
    assert "'t2-roberta-tiny' is bidirectional" in capsys.readouterr().err
    assert not (tmp_path / "cmp" / "t2-lm-tiny").exists()  # refused before any training
    # mlm with a causal preset: the first preset had trained before the second failed
    assert main(["compare", "--presets", "t2-roberta-tiny,t2-lm-tiny", "--task", "mlm", "--max-steps", "1",
                 *common]) == 2
    assert "'t2-lm-tiny' is causal" in capsys.readouterr().err
    assert not (tmp_path / "cmp" / "t2-roberta-tiny").exists()
    from transnormer.data import train_bpe

    big = train_bpe([(root / "train.txt").read_text()], vocab_size=600)
    big.save(tmp_path / "big")
    assert main(["generate", "--model", str(out), "--tokenizer", str(tmp_path / "big"), "--prompt", "x"]) == 2
    assert "is not the tokenizer the model in" in capsys.readouterr().err
    from transformers import AutoModelForCausalLM

    from transnormer.cli import resolve_model_dir

    AutoModelForCausalLM.from_pretrained(resolve_model_dir(out)).save_pretrained(tmp_path / "bare")  # no tokenizer
    assert main(["generate", "--model", str(tmp_path / "bare"), "--tokenizer", str(tmp_path / "big"), "--prompt",
                 "x"]) == 2
    assert "more than the model's vocab_size" in capsys.readouterr().err


def test_a_tokenizer_other_than_the_models_own_is_refused(run_dir, tmp_path, capsys):
    """eval (and a fine-tune with --init-from) had run on with another tokenizer given by
    --tokenizer: a smaller one silently (ppl 12,369: every id another token's embedding), a larger
    one with a message about --vocab-size, which eval does not have. The model's own, given by
    --tokenizer, is taken."""
    from transnormer.cli import resolve_model_dir
    from transnormer.data import train_bpe

    root, out = run_dir
    train_bpe([(root / "train.txt").read_text()], vocab_size=280).save(tmp_path / "other")
    common = ["--data", str(root), "--seq-len", "32", "--cache-dir", str(root / "cache")]
    for argv in (["eval", "--model", str(out), "--max-batches", "1"],
                 ["train", "--init-from", str(out), "--max-steps", "1", "--out", str(tmp_path / "ft")]):
        assert main([*argv, *common, "--tokenizer", str(tmp_path / "other")]) == 2
        err = capsys.readouterr().err
        assert f"is not the tokenizer the model in {resolve_model_dir(out)} was trained with" in err, err
    assert not (tmp_path / "ft").exists()
    own = resolve_model_dir(out) / "tokenizer"
    assert main(["eval", "--model", str(out), "--max-batches", "1", *common, "--tokenizer", str(own)]) == 0


def test_dilution_names_its_flag_and_refuses_a_name_both_preset_and_folder(run_dir, tmp_path, capsys, monkeypatch):
    """--models t2-lm-tiny in a folder holding a run of that name had analysed the run, labelled
    as the preset; a folder with no model was reported under --model."""
    root, _ = run_dir
    (tmp_path / "t2-lm-tiny").mkdir()
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path)
    argv = ["analyze", "dilution", "--data", str(root), "--seq-len", "32", "--samples", "1", "--out", "dil"]
    assert main([*argv, "--models", "t2-lm-tiny"]) == 2
    assert "'t2-lm-tiny' is both a preset and a folder here; write ./t2-lm-tiny" in capsys.readouterr().err
    assert main([*argv, "--models", "empty"]) == 2
    assert "--models: no model in empty" in capsys.readouterr().err


def test_compare_marks_a_diverged_run_and_exits_non_zero(run_dir, tmp_path, capsys, monkeypatch):
    """A run that diverged had its last interval evaluation tabulated as its result, with rc 0."""
    import transnormer.train.compare as compare_mod

    root, _ = run_dir

    def fake(cfg):
        bad = cfg.preset == "vanilla-lm-tiny"
        return {"name": cfg.preset, "params": 1e6, "steps": 6 if bad else 16, "tokens": 100, "tokens_per_s": 10.0,
                "peak_mem_mb": 1.0, "eval": None if bad else {"loss": 5.0, "ppl": 148.4},
                "diverged_at": 6 if bad else None}

    monkeypatch.setattr(compare_mod, "_train_isolated", fake)
    argv = ["compare", "--presets", "t2-lm-tiny,vanilla-lm-tiny", "--data", str(root), "--max-steps", "16",
            "--out", str(tmp_path / "cmp")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "diverged" in err and "vanilla-lm-tiny at step 6" in err
    table = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "| vanilla-lm-tiny | 1.00M | 6 |" in table and "diverged at step 6" in table
    assert "| 5.0000 | 148.40 |" in table
    # --sample skips a diverged first run (it saves no weights: "--model: no model", rc 2, had hidden
    # the divergence) and samples the first that finished
    import transnormer.cli as cli_mod

    sampled = []
    monkeypatch.setattr(cli_mod, "generate_text", lambda model, prompt, **kw: sampled.append((Path(model).name, prompt)))
    monkeypatch.setattr(cli_mod, "resolve_model_dir", lambda p: p)
    swapped = ["compare", "--presets", "vanilla-lm-tiny,t2-lm-tiny", *argv[3:], "--sample"]
    assert main(swapped) == 1
    assert sampled == [("t2-lm-tiny", "Return the")] and "vanilla-lm-tiny at step 6" in capsys.readouterr().err
    assert main(["compare", "--presets", "vanilla-lm-tiny", *argv[3:], "--sample"]) == 1
    assert "no sample: every run diverged" in capsys.readouterr().out and len(sampled) == 1
    assert main([*argv, "--sample-prompt", "def"]) == 2  # read by nothing without --sample: had been silent
    assert "--sample-prompt is the prompt of --sample" in capsys.readouterr().err


def test_generate_refuses_a_length_past_the_models_positions():
    """A prompt + --max-new-tokens past learned positions (or a causal cosFormer's M) had failed after
    streaming part of the text, naming a config field."""
    from transnormer.cli import _check_decodable_length
    from transnormer.presets import build_model

    learned = build_model("t2-lm-tiny", abs_pos="learned", max_position_embeddings=64)
    _check_decodable_length(learned, 8, 57)  # positions 0 .. 63
    with pytest.raises(ValueError, match=r"--max-new-tokens 58 needs 65 positions, but the model has 64 .*learned"):
        _check_decodable_length(learned, 8, 58)
    with pytest.raises(ValueError, match=r"at most --max-new-tokens 1 or"):
        _check_decodable_length(learned, 64, 2)
    # a prompt too long by itself: "at most --max-new-tokens 0" had been advised, which the flag refuses
    with pytest.raises(ValueError, match=r"the prompt alone is too long: shorten it to at most 64 tokens"):
        _check_decodable_length(learned, 65, 1)
    cos = build_model("cosformer-lm-tiny", layer_options={"cosformer": {"max_len": 32}})
    with pytest.raises(ValueError, match=r"has 32 \(its cosFormer re-weighting length M"):
        _check_decodable_length(cos, 20, 20)
    _check_decodable_length(build_model("t2-lm-tiny"), 10_000, 10_000)  # sinusoids: no limit


@pytest.mark.parametrize("flags,match", [
    (["--weight-decay", "inf"], "weight_decay (--weight-decay) must be finite"),  # had saved NaN weights with rc 0
    (["--clip", "inf"], "clip (--clip) must be finite, got inf (0 turns clipping off)"),
    (["--set", "hidden_size"], "transnormer train: error: --set expects KEY=VALUE"),  # had exited 1, no prefix
    (["--config", "/nonexistent/config.json"], "is not a readable JSON config"),
    (["--set", "hidden_size=33"], "hidden_size (33) must be divisible by the number of heads"),
    # the preset had been ignored, and recorded in train_config.json as the run's
    (["--preset", "vanilla-lm-tiny", "--init-from", "/nonexistent"],
     "--preset names a model to build; with --init-from the model is that one"),
    (["--preset", "vanilla-lm-tiny", "--config", "/nonexistent/config.json"], "with --config the model is that one"),
    # (had failed after the corpus and tokenizer, naming TransNormerForMaskedLM's config)
    (["--task", "mlm"], "but preset 't2-lm-tiny' is causal (causal=True); use a -roberta preset"),
    (["--preset", "t2-roberta-tiny"], "task 'clm' needs a causal model, but preset 't2-roberta-tiny' is bidirectional"),
])
def test_train_refuses_bad_settings_before_any_data_work(tmp_path, capsys, flags, match):
    """Each had been found after the corpus and tokenizer were built (or not at all)."""
    cache = tmp_path / "cache"
    assert _exit_code(["train", "--data", "stdlib", "--max-steps", "1", "--out", str(tmp_path / "run"),
                       "--cache-dir", str(cache), *flags]) == 2
    assert match in capsys.readouterr().err
    assert not cache.exists()


def test_outputs_are_checked_before_any_work(run_dir, tmp_path, capsys):
    root, out = run_dir
    (tmp_path / "afile").write_text("")
    argv = ["eval", "--model", str(out), "--data", str(root), "--seq-len", "32", "--max-batches", "1"]
    assert _exit_code([*argv, "--out", str(tmp_path / "afile" / "r.json")]) == 2  # had evaluated first
    assert "--out" in (err := capsys.readouterr().err) and "is a file, not a folder" in err
    assert _exit_code([*argv, "--out", str(tmp_path)]) == 2
    assert "is a folder; give a file name" in capsys.readouterr().err
    assert _exit_code(["analyze", "gradient-bound", "--out", str(tmp_path / "afile")]) == 2
    assert "is a file; give a folder" in capsys.readouterr().err
    assert _exit_code(["generate", "--model", str(out), "--prompt", "x", "--max-new-tokens", "-1"]) == 2
    assert "--max-new-tokens" in capsys.readouterr().err


def test_train_refuses_an_out_inside_a_runs_checkpoints(run_dir, capsys):
    """--resume with --out RUN/checkpoints (or one checkpoint) had found no checkpoint "under
    RUN/checkpoints/checkpoints" and trained a new run inside the old one's checkpoints."""
    root, out = run_dir
    for inside in (out / "checkpoints", out / "checkpoints" / "step-00000003"):
        before = sorted(p.name for p in inside.iterdir())
        assert _exit_code(["train", "--data", str(root), "--max-steps", "1", "--out", str(inside), "--resume"]) == 2
        assert f"is a run's checkpoint folder; give the run directory {str(out)!r}" in capsys.readouterr().err
        assert sorted(p.name for p in inside.iterdir()) == before


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generate_never_samples_an_id_the_tokenizer_lacks(run_dir, tmp_path, monkeypatch, temperature):
    # a model wider than its tokenizer (--set vocab_size=N) had sampled ids past the tokenizer and
    # failed decoding them, after streaming the text
    import torch
    from transformers import AutoModelForCausalLM

    from transnormer.cli import generate_text, resolve_model_dir
    from transnormer.train.checkpoint import model_tokenizer

    _, out = run_dir
    ckpt = resolve_model_dir(out)
    n = model_tokenizer(ckpt).vocab_size
    wide = AutoModelForCausalLM.from_pretrained(ckpt)
    wide.resize_token_embeddings(n + 40)
    wide.save_pretrained(tmp_path / "wide")
    real = AutoModelForCausalLM.from_pretrained.__func__

    def loaded(cls, *a, **k):  # the extra ids made the likeliest by far
        model = real(cls, *a, **k)
        model.get_output_embeddings().register_forward_hook(lambda m, i, o: o.index_fill(-1, torch.arange(n, n + 40), 1e4))
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(loaded))
    text = generate_text(tmp_path / "wide", "def", max_new_tokens=4, stream=False, temperature=temperature,
                         tokenizer=str(ckpt / "tokenizer"))
    assert text.startswith("def")


def test_a_run_or_checkpoint_folder_gives_its_tokenizer(run_dir, tmp_path):
    # such folders had gone on to AutoTokenizer, which asked for sentencepiece or tiktoken
    from transformers import AutoModelForCausalLM

    from transnormer.cli import resolve_model_dir
    from transnormer.train.checkpoint import model_tokenizer, tokenizer_from_arg

    _, out = run_dir
    step = resolve_model_dir(out)
    own = model_tokenizer(step).fingerprint
    for folder in (out, out / "checkpoints", step, step / "tokenizer"):
        assert tokenizer_from_arg(str(folder)).fingerprint == own
    AutoModelForCausalLM.from_pretrained(step).save_pretrained(tmp_path / "bare")
    with pytest.raises(ValueError, match=r"--tokenizer '.*bare' is a model folder .* saved without a tokenizer"):
        tokenizer_from_arg(str(tmp_path / "bare"))


def test_train_saves_a_local_data_path_resolved(tmp_path, monkeypatch):
    """A run saves --data resolved, so that eval run from another folder finds the run that trained on
    it (its data seed, a classifier's columns and reading options): saved as given, a relative path
    resolved against eval's folder named another file, and eval read the data with defaults."""
    from transnormer.cli import _run_config_for, _train_config, build_parser

    (tmp_path / "a" / "corpus").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    parse = build_parser().parse_args
    cfg = _train_config(parse(["train", "--preset", "t2-lm-tiny", "--data", "corpus"]))
    assert cfg.data == str((tmp_path / "a" / "corpus").resolve())
    for kept in ("stdlib", "hf:wikitext:wikitext-2-raw-v1", "missing_here"):  # names, or a path that fails later
        assert _train_config(parse(["train", "--preset", "t2-lm-tiny", "--data", kept])).data == kept
    # a link keeps its own name (the reader takes split and compression from it: a Hugging Face
    # snapshot's wiki.train.txt.gz links to a blob named by hash), and a pipe stays as given
    (tmp_path / "blob").write_text("x")
    (tmp_path / "a" / "wiki.train.txt").symlink_to(tmp_path / "blob")
    linked = _train_config(parse(["train", "--preset", "t2-lm-tiny", "--data", "wiki.train.txt"])).data
    assert linked == str(tmp_path / "a" / "wiki.train.txt")
    os.mkfifo(tmp_path / "a" / "pipe")
    assert _train_config(parse(["train", "--preset", "t2-lm-tiny", "--data", "pipe"])).data == "pipe"
    model = tmp_path / "model"
    model.mkdir()
    (model / "train_config.json").write_text(json.dumps({"data": cfg.data, "data_seed": 3}))
    monkeypatch.chdir(tmp_path / "b")
    assert _run_config_for(model, "../a/corpus")["data_seed"] == 3


def test_eval_of_a_classifier_asks_for_its_data(capsys):
    # the corpus default had been read as a classification file: "'stdlib' is neither a classification file ..."
    assert main(["eval", "--model", "nowhere", "--task", "cls"]) == 2
    assert "--data is required with --task cls" in capsys.readouterr().err
    assert main(["eval", "--model", "nowhere", "--truncate"]) == 2  # (stored False: the cls-only check passed it)
    assert "--truncate applies to --task cls only, not --task clm" in capsys.readouterr().err
