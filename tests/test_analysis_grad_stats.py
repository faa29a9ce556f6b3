"""GradientRecorder and RSD summaries; the scaling-ablation driver."""

import json
import math

import pytest
import torch

from conftest import write_small_corpus
from transnormer.analysis import (
    GradientRecorder,
    ablation_configs,
    curve_stats,
    rsd_from_jsonl,
    run_grad_stats,
    run_scaling_ablation,
)
from transnormer.analysis.ablation import linear_elu_registered
from transnormer.analysis.grad_stats import summarize
from transnormer.models.presets import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny():
    torch.manual_seed(0)
    return build_model("t2-lm-tiny", num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                       vocab_size=64, block_size=8, chunk_size=8)


def _train(model, recorders, steps=6):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(steps):
        ids = torch.randint(0, 64, (2, 16))
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        for r in recorders:
            r.record(model, step)
        opt.step()


def test_recorder_rsd_and_files(tmp_path):
    model = _tiny()
    rec = GradientRecorder(per_layer=True, jsonl_path=tmp_path / "g.jsonl", sync_every=4)
    rec_all = GradientRecorder("all")
    _train(model, [rec, rec_all])
    # the recorded norm is the L2 norm over the *.mixer.* gradients
    manual = torch.sqrt(sum(p.grad.pow(2).sum() for n, p in model.named_parameters() if ".mixer." in n))
    assert rec.summary()["num_steps"] == 6 and rec.values[-1] == pytest.approx(float(manual), rel=1e-5)
    assert all(a >= m for a, m in zip(rec_all.values, rec.values, strict=True))
    rsd = rec.rsd()
    assert math.isfinite(rsd) and rsd > 0
    assert rec.rsd(start=2, end=4) == rec.summary(2, 4)["rsd"] and rec.summary(2, 4)["step_range"] == [2, 4]
    s = json.loads(rec.save_summary(tmp_path / "rsd.json").read_text())
    assert s["mode"] == "norm_over_steps" and s["param_set"] == "mixer" and s["step_range"] == [0, 5]
    assert set(s["per_layer"]) == {"layers.0", "layers.1"}
    assert all(math.isfinite(v["rsd"]) for v in s["per_layer"].values())
    # per-layer norms combine to the total
    lines = [json.loads(x) for x in (tmp_path / "g.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(6))
    assert math.hypot(*lines[0]["per_layer"].values()) == pytest.approx(lines[0]["grad_norm"], rel=1e-6)
    # the JSONL helper gives the same RSD, and the run_* entry point writes JSON + PNG
    assert rsd_from_jsonl(tmp_path / "g.jsonl")["rsd"] == pytest.approx(rsd)
    out = run_grad_stats(tmp_path / "g.jsonl", tmp_path / "out")
    assert out["param_set"] == "mixer" and (tmp_path / "out" / "grad_norms.png").exists()
    rec.save_jsonl(tmp_path / "copy.jsonl")
    assert rsd_from_jsonl(tmp_path / "copy.jsonl")["rsd"] == pytest.approx(rsd)


def test_recorder_options():
    model = _tiny()
    with pytest.raises(ValueError, match="params"):
        GradientRecorder("attention")
    with pytest.raises(ValueError, match="sync_every must be >= 1"):  # had become 1 silently
        GradientRecorder(sync_every=0)
    with pytest.raises(ValueError, match="no trainable parameter"):
        GradientRecorder(["*.nonexistent.*"]).record(model, 0)
    rec = GradientRecorder(["*.q_proj.*"])
    rec.record(model, 0)  # no backward yet: skipped, not a zero
    assert rec.skipped_steps == [0] and rec.summary()["rsd"] is None


def test_rsd_from_metrics_jsonl(tmp_path):
    p = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "loss": 3.0}, {"step": 2, "attn_grad_norm": 1.0}, {"step": 3, "attn_grad_norm": 3.0},
            {"step": 4, "attn_grad_norm": float("nan")}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    s = rsd_from_jsonl(p, "attn_grad_norm", param_set="mixer")
    assert s["rsd"] == pytest.approx(0.5) and s["num_steps"] == 2 and s["num_nonfinite"] == 1


# ----------------------------------------------------------------------------- ablation


def test_ablation_configs_differ_only_in_mixers():
    cfgs = ablation_configs("t2-lm-tiny")
    dicts = {k: v.to_dict() for k, v in cfgs.items()}
    strip = [{k: v for k, v in d.items() if k not in ("mixer_types", "layer_options", "lrpe", "norm_kernel")}
             for d in dicts.values()]
    assert all(s == strip[0] for s in strip)
    assert cfgs["norm"].lrpe == "none"  # linear_elu has no positional encoding inside: only the norm differs
    assert dicts["linear_elu_no_denom"]["layer_options"]["linear_elu"] == {"kernel": "1+elu", "denominator": False}
    assert dicts["linear_elu"]["layer_options"]["linear_elu"] == {"kernel": "1+elu", "denominator": True}
    assert set(cfgs["norm"].layer_types) == {"norm"}


def test_ablation_arms_keep_their_denominators_whatever_the_base():
    # a linear-elu-noscale base's own denominator=False had made both linear arms one model
    for base in ("linear-elu-noscale-lm-tiny", "t2-lm-tiny"):
        mixers = {name: build_model(c).model.layers[0].mixer for name, c in ablation_configs(base).items()
                  if name != "norm"}
        assert mixers["linear_elu"].denominator and not mixers["linear_elu_no_denom"].denominator, base


def test_ablation_norm_arm_takes_the_linear_arms_kernel():
    """A T1 base's NormAttention uses elu; the arms must differ in the norm alone, so the norm arm
    takes 1+elu as the linear_elu layers do."""
    for base in ("t1-lm-tiny", "t2-roberta-tiny"):
        cfgs = ablation_configs(base)
        assert cfgs["norm"].resolved("norm_kernel") == "1+elu", base
        mixers = {name: build_model(c).model.layers[0].mixer for name, c in cfgs.items()}
        assert {getattr(m, "kernel_name", None) for m in mixers.values()} == {"1+elu"}, base
        assert all(not c.causal for c in cfgs.values()) == (base == "t2-roberta-tiny")


def test_ablation_driver_with_fake_training(tmp_path):
    def fake_train(cfg, budget):
        if cfg == "blows_up":
            return [(s, 5.0 + s) for s in range(budget - 1)] + [(budget - 1, float("nan"))]
        return [(s, 5.0 / (1 + s)) for s in range(budget)]

    out = run_scaling_ablation(fake_train, 10, tmp_path, configs={"a": "ok", "b": "blows_up", "c": "ok"})
    assert [out["stats"][k]["diverged"] for k in "abc"] == [False, True, False]
    assert (tmp_path / "ablation.png").exists() and json.loads((tmp_path / "ablation.json").read_text())["budget"] == 10
    assert curve_stats([(0, 2.0), (1, 3.0)])["diverged"]


@pytest.mark.slow
def test_ablation_cli_under_torchrun(tmp_path):
    """Its three runs share one process group (each had made and destroyed its own: the second
    failed to connect), and rank 0 alone writes the results."""
    import os
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text("import sys\nfrom transnormer.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    out = tmp_path / "abl"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                    str(script), "analyze", "ablation", "--data", write_small_corpus(tmp_path / "data"),
                    "--budget", "256", "--seq-len", "16", "--batch-size", "2", "--vocab-size", "300",
                    "--cache-dir", str(tmp_path / "cache"), "--out", str(out)],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert set(json.loads((out / "ablation.json").read_text())["stats"]) == {"norm", "linear_elu",
                                                                             "linear_elu_no_denom"}


@pytest.mark.skipif(not linear_elu_registered(),
                    reason="layer type 'linear_elu' not registered yet (baseline layers are added concurrently)")
def test_ablation_models_build():
    for name, cfg in ablation_configs("t2-lm-tiny", num_hidden_layers=2).items():
        model = build_model(cfg)
        ids = torch.randint(0, cfg.vocab_size, (1, 16))
        assert torch.isfinite(model(input_ids=ids).logits).all(), name


def test_recorder_norms_accumulate_in_fp32_whatever_the_gradient_dtype():
    """bf16 gradients rounded the norm to bf16 (258 for 257.1) and fp16 ones overflowed to inf."""
    for dtype, scale in ((torch.bfloat16, 1.0), (torch.float16, 4000.0)):
        torch.manual_seed(0)
        layer = torch.nn.Linear(64, 64).to(dtype)
        model = torch.nn.ModuleDict({"mixer": layer})
        layer.weight.grad = (torch.randn(64, 64) * scale).to(dtype)
        layer.bias.grad = (torch.randn(64) * scale).to(dtype)
        rec = GradientRecorder("mixer")
        rec.record(model, 1)
        exact = math.sqrt(sum(float(g.double().pow(2).sum()) for g in (layer.weight.grad, layer.bias.grad)))
        assert exact > 6e4 or dtype == torch.bfloat16  # fp16: a norm past the fp16 range
        assert rec.values == [pytest.approx(exact, rel=1e-6)]


def test_a_new_recording_starts_its_file_anew_and_mixed_records_are_refused(tmp_path):
    path = tmp_path / "g.jsonl"
    for seed in (0, 1):
        torch.manual_seed(seed)
        rec = GradientRecorder(jsonl_path=path, sync_every=2)
        _train(_tiny(), [rec], steps=3)
        rec.flush()
        assert rsd_from_jsonl(path)["num_steps"] == 3
        assert rsd_from_jsonl(path)["rsd"] == pytest.approx(rec.rsd())
    # resume=True reads the file back and continues it
    rec = GradientRecorder(jsonl_path=path, resume=True)
    assert rec.steps == [0, 1, 2]
    path.write_text(path.read_text() * 2)  # two runs' records in one file
    with pytest.raises(ValueError, match="steps must increase"):
        rsd_from_jsonl(path)


def test_fp64_gradients_are_recorded_in_fp64():
    # _foreach_norm(dtype=fp32) refused fp64 gradients
    lin = torch.nn.Linear(3, 2).double()
    lin(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
    rec = GradientRecorder("all")
    rec.record(lin, 1)
    want = torch.sqrt(sum(p.grad.pow(2).sum() for p in lin.parameters()))
    assert rec.values[0] == pytest.approx(float(want), rel=1e-15)


def test_resumed_per_layer_lists_stay_aligned(tmp_path):
    # a file written without per_layer, resumed with it, left the per-layer lists short (zip errors)
    p = tmp_path / "grad_norms.jsonl"
    p.write_text("".join(json.dumps({"step": s, "grad_norm": 1.0 + s}) + "\n" for s in (1, 2)))
    model = _tiny()
    rec = GradientRecorder("mixer", per_layer=True, jsonl_path=p, resume=True)
    model(torch.randint(0, 50, (1, 8)), labels=torch.randint(0, 50, (1, 8))).loss.backward()
    rec.record(model, 3)
    s = rec.summary()
    assert rec.steps == [1, 2, 3] and all(len(v) == 3 for v in rec.layer_values.values())
    assert all(lay["num_steps"] == 1 for lay in s["per_layer"].values())
    rec.save_jsonl(tmp_path / "copy.jsonl")


def test_resumed_per_layer_groups_keep_the_files_layer_order(tmp_path):
    # they had come back in the hash order of a set (layers.7 before layers.0 ...), and so in the
    # summary, the plot's legend and the file written back
    p = tmp_path / "grad_norms.jsonl"
    groups = [f"layers.{i}" for i in range(12)] + ["other"]
    p.write_text("".join(json.dumps({"step": s, "grad_norm": 1.0, "per_layer": {g: 1.0 + i for i, g in
                                                                             enumerate(groups)}}) + "\n"
                         for s in (1, 2)))
    rec = GradientRecorder("all", per_layer=True, jsonl_path=p, resume=True)
    assert list(rec.layer_values) == groups
    assert list(rec.summary()["per_layer"]) == groups
    rec.save_jsonl(tmp_path / "copy.jsonl")
    assert list(json.loads((tmp_path / "copy.jsonl").read_text().splitlines()[0])["per_layer"]) == groups


def test_a_gap_in_the_recorded_steps_is_counted(tmp_path):
    # steps 4-6 trained without --grad-stats between two resumes: step_range [1, 9] had claimed them
    p = tmp_path / "grad_norms.jsonl"
    p.write_text("".join(json.dumps({"step": s, "grad_norm": 1.0 + s}) + "\n" for s in (1, 2, 3, 7, 8, 9)))
    rec = GradientRecorder("mixer", jsonl_path=p, resume=True)
    s = rec.summary()
    assert s["step_range"] == [1, 9] and s["num_steps"] == 6 and s["missing_steps"] == 3
    assert rec.summary(start=7)["missing_steps"] == 0
    # the file read alone (analyze grad-stats) says the gap too; the loss, logged every few steps, has none
    assert summarize([1.0] * 6, [1, 2, 3, 7, 8, 9], param_set="mixer")["missing_steps"] == 3
    assert "missing_steps" not in summarize([1.0] * 2, [10, 20], param_set="mixer", key="loss")


def test_rsd_from_a_training_metrics_file_reads_train_records_only(tmp_path):
    # eval records carry "loss" at train steps: "steps must increase" had stopped --key loss
    p = tmp_path / "metrics.jsonl"
    rows = [{"kind": "train", "step": 1, "loss": 3.0, "grad_norm": 1.0},
            {"kind": "train", "step": 2, "loss": 2.0, "grad_norm": 3.0},
            {"kind": "eval", "step": 2, "loss": 2.5}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert rsd_from_jsonl(p, "loss")["num_steps"] == 2
    assert rsd_from_jsonl(p)["param_set"] == "all"  # the loop's grad_norm: all parameters
    with pytest.raises(ValueError, match="start"):
        rsd_from_jsonl(p, start=5, end=1)
    with pytest.raises(ValueError, match="no recorded step lies in"):
        rsd_from_jsonl(p, start=10, end=20)
    # the loop's grad_norm is over all parameters: naming it "mixer" would mislabel the report
    with pytest.raises(ValueError, match="records norms over all"):
        rsd_from_jsonl(p, param_set="mixer")
    assert rsd_from_jsonl(p, param_set="all")["param_set"] == "all"
    # one step has no spread: an RSD of 0 would read as perfectly stable gradients
    one = rsd_from_jsonl(p, start=2)
    assert one["num_steps"] == 1 and one["rsd"] is None and one["mean"] == 3.0


def test_ablation_cli_trains_masked_lms_from_a_bidirectional_base(tmp_path, monkeypatch):
    """The paper's Table 1 ablation is a bidirectional LM: such a base trains three masked LMs."""
    from pathlib import Path

    import transnormer.train.loop as loop
    from transnormer.cli import main

    tasks = []

    def fake_train(cfg):
        tasks.append(cfg.task)
        out = Path(cfg.out_dir)
        (out / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 9.0 - 0.1 * s})
                                                   + "\n" for s in range(1, 4)))
        return {"diverged_at": None}

    monkeypatch.setattr(loop, "train", fake_train)
    assert main(["analyze", "ablation", "--base", "t2-roberta-tiny", "--budget", "10", "--out", str(tmp_path)]) == 0
    assert tasks == ["mlm"] * 3
    configs = [json.loads((tmp_path / n / "model_config.json").read_text()) for n in ("norm", "linear_elu")]
    assert not any(c["causal"] for c in configs)


def test_ablation_cli_marks_a_run_the_loop_stopped(tmp_path, monkeypatch):
    """The loop stops at a non-finite gradient after logging that step's finite loss; the ablation
    dropped train()'s diverged_at and showed the stopped run as healthy."""
    from pathlib import Path

    import transnormer.train.loop as loop
    from transnormer.cli import main

    def fake_train(cfg):
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        stopped = out.name == "linear_elu_no_denom"
        n = 3 if stopped else 6
        (out / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 9.0 - 0.1 * s})
                                                   + "\n" for s in range(1, n + 1)))
        return {"diverged_at": n if stopped else None}

    monkeypatch.setattr(loop, "train", fake_train)
    assert main(["analyze", "ablation", "--budget", "10", "--out", str(tmp_path)]) == 0
    stats = json.loads((tmp_path / "ablation.json").read_text())["stats"]
    assert {k: v["diverged"] for k, v in stats.items()} == {"linear_elu": False, "linear_elu_no_denom": True,
                                                            "norm": False}


def test_grad_stats_refuses_bad_records_by_file_record_and_key(tmp_path):
    # a string had failed naming neither file nor key, true was read as 1.0, a negative norm averaged in
    from transnormer.analysis.grad_stats import rsd_from_jsonl

    p = tmp_path / "g.jsonl"
    for rows, match in (([{"step": 1, "grad_norm": "abc"}], "record 1: 'grad_norm' must be a number or null"),
                        ([{"step": 1, "grad_norm": 1.0}, {"step": "x", "grad_norm": 1.0}],
                         "record 2: 'step' must be an integer step, got 'x'"),
                        ([{"step": 1, "grad_norm": True}], "must be a number or null, got True"),
                        ([{"step": 1, "grad_norm": 1.0}, {"step": 2, "grad_norm": -1.0}], "cannot be negative")):
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(ValueError, match=match):
            rsd_from_jsonl(p)
    p.write_text("".join(json.dumps({"step": s, "grad_norm": 1.0, "param_set": "mixer"}) + "\n" for s in (1, 2, 4)))
    assert rsd_from_jsonl(p)["missing_steps"] == 1  # the recorder's file holds every step: 3 is missing
    # a run's metrics.jsonl logs every --log-every steps: its gaps are not missing steps
    p.write_text("".join(json.dumps({"kind": "train", "step": s, "grad_norm": 1.0 + s}) + "\n" for s in (1, 10, 20)))
    s = rsd_from_jsonl(p)
    assert s["num_steps"] == 3 and "missing_steps" not in s


def test_ablation_cli_resumes_its_runs(tmp_path, monkeypatch, capsys):
    """An interrupted run's message says the same command with --resume continues it; ablation had
    refused --resume, and without it the runs start again from step 0."""
    from pathlib import Path

    import transnormer.train.loop as loop
    from transnormer.cli import main

    calls = []

    def fake_train(cfg):
        calls.append((Path(cfg.out_dir).name, cfg.resume))
        (Path(cfg.out_dir) / "metrics.jsonl").write_text(
            "".join(json.dumps({"kind": "train", "step": s, "loss": 9.0 - 0.1 * s}) + "\n" for s in range(1, 4)))
        interrupted = not cfg.resume and Path(cfg.out_dir).name == "linear_elu_no_denom"
        return {"diverged_at": None, "interrupted_at": 2 if interrupted else None}

    monkeypatch.setattr(loop, "train", fake_train)
    assert main(["analyze", "ablation", "--budget", "10", "--out", str(tmp_path)]) == 130
    assert not (tmp_path / "ablation.json").exists()
    assert main(["analyze", "ablation", "--budget", "10", "--out", str(tmp_path), "--resume"]) == 0
    assert calls == [("linear_elu", False), ("linear_elu_no_denom", False),
                     ("linear_elu", True), ("linear_elu_no_denom", True), ("norm", True)]
    assert (tmp_path / "ablation.json").exists()


def test_grad_stats_reads_a_file_cut_short_and_names_the_key(tmp_path):
    # a last line cut mid-write (a run killed or still writing) had been a raw json error naming
    # "line 1"; another key's plot was labelled a gradient norm and its RSD "norm_over_steps"
    import matplotlib

    from transnormer.analysis import run_grad_stats

    p = tmp_path / "metrics.jsonl"
    rows = [{"kind": "train", "step": s, "loss": 4.0 - 0.1 * s, "grad_norm": 1.0 + 0.1 * s} for s in range(1, 11)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "train", "step": 11, "loss": 4.1, "gra')
    backend = matplotlib.get_backend()
    assert rsd_from_jsonl(p, "grad_norm")["num_steps"] == 10
    res = run_grad_stats(p, tmp_path / "out", key="loss")
    assert res["num_steps"] == 10 and res["mode"] == "rsd_over_steps(loss)"
    assert rsd_from_jsonl(p)["mode"] == "norm_over_steps"
    assert matplotlib.get_backend() == backend
    p.write_text("not json\n" + "".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 1 is not a JSON record"):
        rsd_from_jsonl(p)
