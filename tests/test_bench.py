"""The benchmark harness's verdict lines (bench/suite.py)."""

import json
import mmap
import sys

import pytest


def test_ratio_verdict_says_which_side_of_the_ideal():
    from transnormer.bench.suite import ratio_verdict

    assert ratio_verdict("x", "t2-lm", "vanilla-lm", 1.05, 1.0).startswith("PASS")
    ahead = ratio_verdict("x", "t2-lm", "vanilla-lm", 2.0, 1.5)
    assert ahead.startswith("FAIL") and "t2-lm ahead of its FLOP ratio" in ahead and "vanilla-lm runs" in ahead
    behind = ratio_verdict("x", "t2-lm", "vanilla-lm", 0.8, 1.0)
    assert behind.startswith("FAIL") and "behind" in behind


def test_norm_attn_flops_counts_the_chunked_algorithm():
    from transnormer.bench.ops_bench import norm_attn_flops

    T, D, E, c = 256, 8, 4, 64
    fwd_causal = 4 * T * D * E + 2 * T * c * (D + E)  # states and queries + full c x c score tiles
    assert norm_attn_flops(T, D, E, causal=True, chunk=c, batch_heads=3) == 3.0 * fwd_causal * 3
    assert norm_attn_flops(T, D, E, causal=False, chunk=c, batch_heads=1) == 3.0 * 4 * T * D * E
    useful = 4 * T * D * E + T * c * (D + E)  # the kernels skip the zero half of the score tiles
    assert norm_attn_flops(T, D, E, causal=True, chunk=c, batch_heads=1, useful=True) == 3.0 * useful
    # a partial last chunk of 36 rows: 36 x 36 tiles, not 36 x 64 (T=100 had read 8.5% high)
    T = 100
    fwd = 4 * T * D * E + 2 * (64 * 64 + 36 * 36) * (D + E)
    assert norm_attn_flops(T, D, E, causal=True, chunk=c, batch_heads=1) == 3.0 * fwd


def test_op_throughput_reports_the_backend_that_ran():
    import torch

    from transnormer.bench.ops_bench import op_throughput, same_shape_gemm_gflops
    from transnormer.ops import _native

    for dtype in (torch.float32, torch.bfloat16):
        for causal in (True, False):
            r = op_throughput(96, causal=causal, dtype=dtype, H=2, repeat=1, min_time=0.0)
            built = _native.load() is not None
            fused = built and (dtype == torch.float32 or _native.bf16_ready())
            upcast = built and causal and dtype == torch.bfloat16 and not _native.bf16_ready()
            assert r["backend"] == ("native-fp32" if upcast else "native" if fused else "torch")
            bf16_kernel = r["backend"] == "native" and dtype == torch.bfloat16
            assert r["engine"] == (_native.bf16_engine() if bf16_kernel else None)
            assert r["seconds"] > 0 and r["gflops"] > 0
            assert same_shape_gemm_gflops(96, causal=causal, dtype=dtype, H=2, repeat=1, min_time=0.0) > 0


def test_counted_step_flops_is_the_analytic_count_plus_the_masked_scores():
    """The counter sees every product of a step: for a softmax LM that is the analytic count
    (dense layers, head, the causal half of the scores) plus the masked half SDPA's math path
    also multiplies. The kernel backend is restored, whatever it was."""
    from transnormer.bench.train_step import build_bench_model, counted_step_flops, model_flops_per_token
    from transnormer.ops import _native

    T, vocab = 64, 1000
    cfg = build_bench_model("vanilla-lm-tiny", T, vocab, {}).config
    assert set(cfg.layer_types) == {"softmax"}
    masked_half = 3 * 2 * T * cfg.hidden_size * T * cfg.num_hidden_layers  # QKᵀ and AV above the diagonal, x3
    expected = model_flops_per_token(cfg, T) * T + masked_half
    before = _native.backend()
    try:
        for mode in ("auto", "torch"):
            _native.set_backend(mode)
            assert counted_step_flops("vanilla-lm-tiny", T, vocab_size=vocab, isolate=False) == expected
            assert _native.backend() == mode
    finally:
        _native.set_backend(before)
    assert counted_step_flops("vanilla-lm-tiny", T, vocab_size=vocab) == expected  # in a fresh process


def test_alternating_median_takes_turns_and_keeps_each_presets_median_round():
    import pytest

    from transnormer.bench.suite import alternating_median

    calls, times = [], {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 9.0, 4.0])}

    def measure(p):
        calls.append(p)
        return {"step_s": next(times[p]), "round": len(calls)}

    got = alternating_median(measure, ["a", "b"], 3)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert got["a"]["step_s"] == 2.0 and got["a"]["round"] == 5 and got["a"]["step_s_rounds"] == [3.0, 1.0, 2.0]
    assert got["b"]["step_s"] == 5.0 and got["b"]["round"] == 2
    assert alternating_median(lambda p: {"step_s": 1.0}, ["a"], 1)["a"]["step_s_rounds"] == [1.0]
    even = iter([4.0, 1.0, 3.0, 2.0])  # an even count keeps the slower of the middle two
    assert alternating_median(lambda p: {"step_s": next(even)}, ["a"], 4)["a"]["step_s"] == 3.0
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="rounds"):
            alternating_median(measure, ["a"], bad)
    with pytest.raises(ValueError, match="distinct"):
        alternating_median(measure, ["a", "a"], 1)


def test_counted_flops_include_the_in_place_products():
    """addmm_ (the LM loss sums dW over row chunks with it) and baddbmm_ (the chunked
    linear-attention backward) are invisible to torch's stock counter."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from transnormer.bench.train_step import _inplace_products

    a, b, c = torch.randn(6, 5), torch.randn(5, 4), torch.zeros(6, 4)
    a3, b3, c3 = torch.randn(3, 6, 5), torch.randn(3, 5, 4), torch.zeros(3, 6, 4)
    with FlopCounterMode(display=False, custom_mapping=_inplace_products()) as counter:
        c.addmm_(a, b)
        c3.baddbmm_(a3, b3)
    assert counter.get_total_flops() == 2 * 6 * 5 * 4 * (1 + 3)


def test_warm_up_runs_until_a_step_faults_in_little_fresh_memory():
    from transnormer.bench.train_step import _warm_up

    def run(per_step_mb, reading=True, **kw):
        faulted, calls = [0.0], []

        def step():
            faulted[0] += per_step_mb[len(calls)]
            calls.append(None)
            return len(calls)

        return _warm_up(step, (lambda: faulted[0]) if reading else None, **kw)

    assert run([3200, 423, 41, 69, 0, 0, 0]) == (5, 5)  # the t2-lm heap growth measured
    assert run([3200, 10, 500]) == (2, 2)  # at least two steps, then the first quiet one
    assert run([3200, 400, 400, 400, 400, 400, 400, 400]) == (6, 6)  # capped
    assert run([3200, 400, 400], reading=False) == (2, 2)  # no reading (GPU): the minimum
    assert run([100, 100, 100, 0], steady_mb=150) == (2, 2)
    with pytest.raises(ValueError, match="min_steps"):
        run([0], max_steps=0)


def test_the_fault_reading_sees_fresh_memory():
    from transnormer.bench.train_step import _faulted_mb

    size = 64 * 2**20
    block = mmap.mmap(-1, size)  # fresh anonymous pages, none resident until written
    before = _faulted_mb()
    for i in range(0, size, 4096):
        block[i] = 1
    assert _faulted_mb() - before > 48
    block.close()


def test_a_spawned_measurement_reads_its_own_peak_memory():
    """ru_maxrss survives fork + exec, so a child would report its parent's peak; VmHWM does not."""
    import torch

    from transnormer.bench.timing import peak_rss_mb
    from transnormer.runtime import call_in_fresh_process

    big = torch.ones(384 * 2**20 // 4)  # 384 MB touched in this process
    assert peak_rss_mb() > 384
    child = call_in_fresh_process(peak_rss_mb)
    del big
    assert child < peak_rss_mb() - 256


def test_flop_model_is_only_used_where_it_exists(monkeypatch, tmp_path):
    from transnormer.bench import suite
    from transnormer.bench.train_step import model_flops_per_token
    from transnormer.presets import get_config

    with pytest.raises(ValueError, match="no FLOP model"):
        model_flops_per_token(get_config("flash-lm"), 512)
    assert suite.preset_flops_per_token("flash-lm", 1000, 512) is None
    assert suite.preset_flops_per_token("peer:flash-pytorch", 1000, 512) is None
    assert suite.preset_flops_per_token("t2-lm", 1000, 512) > 0
    # a bidirectional config had been counted as causal (vanilla at 16k: 37% under)
    with pytest.raises(ValueError, match="counts causal LMs only"):
        model_flops_per_token(get_config("vanilla-lm", causal=False), 512)
    # a chunk given per layer type (layer_options) is the one the layers run: it had been ignored
    base = model_flops_per_token(get_config("t2-lm"), 512)
    wider = model_flops_per_token(get_config("t2-lm", layer_options={"norm": {"chunk_size": 256}}), 512)
    n_norm = get_config("t2-lm").layer_types.count("norm")
    assert wider - base == pytest.approx(n_norm * 3 * 2 * (256 - 64) * 512)  # the intra-chunk term, 3x

    def fake(preset, T, **kw):
        return {"preset": preset, "seq_len": T, "batch": 1, "step_s": 1.0, "tokens_per_s": float(T),
                "peak_mem_mb": 1.0}

    monkeypatch.setattr(suite, "train_step_throughput", fake)
    monkeypatch.setattr(suite, "gemm_gflops", lambda *a, **k: 100.0)
    for presets in (["peer:flash-pytorch", "t2-lm"], ["flash-lm", "vanilla-lm"]):  # no ratio, no crash
        res = suite.bench_train(tmp_path / presets[0], presets=presets, lengths=(64,), dtypes=("fp32",))
        compared = [v for v in res["verdicts"] if " vs " in v]  # a SKIP that says why (it had been silent)
        assert compared == [f"SKIP  {presets[0]} vs {presets[1]} fp32 T=64: no FLOP count for {presets[0]} (a "
                            "peer, or a layer type the FLOP model lacks), so no ideal ratio to compare with"]


def test_threads_reach_the_measuring_process(monkeypatch):
    import torch

    from transnormer.bench.train_step import train_step_throughput

    before = torch.get_num_threads()
    monkeypatch.setenv("TRANSNORMER_THREADS", "1")
    try:
        row = train_step_throughput("t2-lm-tiny", 64, tokens_per_step=64, vocab_size=128, steps=1, isolate=False)
    finally:
        torch.set_num_threads(before)
    assert row["threads"] == 1


@pytest.mark.parametrize("argv", [["bench", "train", "--lengths", "0"], ["bench", "ops", "--threads", "-1"],
                                  ["bench", "train", "--vocab-size", "0"], ["bench", "train", "--max-step-s", "0"],
                                  ["bench", "infer", "--max-mem-gb", "-2"], ["bench", "infer", "--max-mem-gb", "inf"]])
def test_bench_refuses_sizes_below_one(argv):
    from transnormer.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2


@pytest.mark.parametrize("argv,match", [
    (["bench", "memory", "--lengths", "8"], "--lengths applies to bench ops, train, infer, not memory"),
    (["bench", "ops", "--presets", "t2-lm"], "--presets applies to bench train, infer, not ops"),
    (["bench", "ops", "--max-mem-gb", "1"], "--max-mem-gb applies"),
    (["bench", "long", "--vocab-size", "300"], "--vocab-size applies"),
    (["bench", "long", "--dtypes", "fp32"], "--dtypes: bench long measures its target's bf16 step only"),
    (["bench", "train", "--dtypes", "fp32", "fp32"], "--dtypes: each once"),  # had measured it twice
    (["bench", "train", "--presets", "t2-lm", "bogus-lm"], "bogus-lm"),  # had been found after the GEMM probe
    (["bench", "train", "--presets", "peer:nope"], "unknown peer 'peer:nope'"),
    # these three had been refused only by the measuring process, after the GEMM probe
    (["bench", "train", "--presets", "t2-roberta", "t2-lm"], "'t2-roberta' is bidirectional"),
    (["bench", "infer", "--max-mem-gb", str(2 ** 20)], "--max-mem-gb must be below 2^20 GB"),
    (["bench", "train", "--presets", "peer:performer-pytorch", "t2-lm"], "peer package 'performer_pytorch' is not"),
    # peers.py's hint had been lost to "unknown peer"
    (["bench", "train", "--presets", "peer:sdpa", "t2-lm"], "our 'vanilla-lm' preset is the SDPA softmax baseline"),
    (["bench", "peers"], "bench peers: peer package 'flash_pytorch' is not available"),
])
def test_bench_refuses_options_it_would_ignore_before_measuring(argv, match, tmp_path, capsys, monkeypatch):
    from transnormer.bench import suite
    from transnormer.cli import main

    def measured(*a, **k):
        pytest.fail("measured before refusing")

    for name in ("gemm_gflops", "same_shape_gemm_gflops", "train_step_throughput", "op_throughput"):
        monkeypatch.setattr(suite, name, measured)
    monkeypatch.setitem(sys.modules, "performer_pytorch", None)  # as if not installed
    if argv[1] == "peers":
        _hide_flash_pytorch(monkeypatch)
    assert main([*argv, "--out", str(tmp_path / "b")]) == 2
    assert match in capsys.readouterr().err


def _hide_flash_pytorch(monkeypatch):
    for name in ("flash_pytorch", "flash_pytorch.flash_pytorch"):  # as if not installed (even if imported)
        monkeypatch.setitem(sys.modules, name, None)


def test_bench_all_skips_peers_up_front_when_flash_pytorch_is_missing(tmp_path, capsys, monkeypatch):
    """bench all had run ops, train, infer, memory and long (hours) before finding the peer missing,
    and then exited 2 without its verdicts."""
    from transnormer.bench import suite
    from transnormer.cli import main

    ran = []

    def part(name):
        return lambda *a, **k: ran.append(name) or {"table": f"| {name} |", "verdicts": [f"PASS  {name}"], "files": []}

    for name in ("ops", "train", "memory", "long", "peers"):
        monkeypatch.setattr(suite, f"bench_{name}", part(name))
    _hide_flash_pytorch(monkeypatch)
    assert main(["bench", "all", "--dtypes", "fp32", "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert ran == ["ops", "train", "train", "memory"]  # (train measures train and infer)
    verdicts = out.split("## verdicts")[1]
    assert "SKIP  peers: bench peers: peer package 'flash_pytorch' is not available" in verdicts
    # long's target is a bf16 step: --dtypes fp32 had run it (hours on a CPU without bf16 products)
    assert "SKIP  long: its target is a bf16 step, and --dtypes fp32 leaves bf16 out" in verdicts


def test_a_sweep_records_what_did_not_fit_and_skips_the_presets_longer_lengths(monkeypatch, tmp_path):
    """Many presets against T on one machine: a configuration out of memory or over the time limit
    ends that preset's sweep (in its dtype) with a row saying why, and the others go on."""
    from transnormer.bench import suite

    calls = []

    def fake(preset, T, *, dtype, **kw):
        calls.append((preset, T, dtype))
        if preset == "big" and T >= 256:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")
        if preset == "dies" and T >= 256:
            raise RuntimeError("_measure died in its fresh process (exit code -9) before returning; a negative ...")
        return {"preset": preset, "seq_len": T, "batch": 1, "step_s": T / 64 if preset == "slow" else 1.0,
                "tokens_per_s": 64.0,
                "peak_mem_mb": 1.0}

    monkeypatch.setattr(suite, "train_step_throughput", fake)
    monkeypatch.setattr(suite, "gemm_gflops", lambda *a, **k: 100.0)
    res = suite.bench_train(tmp_path, presets=["t2-lm", "big", "slow", "dies", "vanilla-lm"], lengths=(512, 128, 256),
                            dtypes=("fp32", "bf16"), max_step_s=3.0)
    status = {(r["label"], r["seq_len"]): r["status"] for r in res["rows"]}
    assert status[("big fp32", 128)] == "ok"
    assert status[("big fp32", 256)].startswith("failed: out of memory")
    assert status[("big fp32", 512)] == "skipped: did not fit at T=256"
    assert status[("dies fp32", 256)].startswith("failed: _measure died") and "-9" in status[("dies fp32", 256)]
    assert status[("slow fp32", 256)] == "ok"  # 4 s: over the limit, so its longer lengths are skipped
    assert status[("slow fp32", 512)].startswith("skipped: its step took 4 s at T=256")
    assert status[("t2-lm fp32", 512)] == status[("vanilla-lm bf16", 512)] == "ok"
    assert status[("big bf16", 128)] == "ok"  # each dtype sweeps anew
    assert ("big", 512, "fp32") not in calls and ("slow", 512, "bf16") not in calls
    assert [T for p, T, d in calls if p == "t2-lm" and d == "fp32"] == [128, 256, 512]  # increasing T
    assert "status" in res["table"] and len(status) == len(res["rows"]) == 5 * 3 * 2
    # two verdicts for each measured t2/vanilla ratio: against the model's FLOPs and the executed ones
    ratio = [v for v in res["verdicts"] if "t2-lm vs vanilla-lm fp32 T=512" in v]
    assert [v.split(":")[0].split(" T=512 ")[1] for v in ratio] == ["(model FLOPs)", "(executed FLOPs)"]
    assert "at the 3x convention" in ratio[0] and "counting the kernels' backward recompute" in ratio[1]

    calls.clear()
    res = suite.bench_train(tmp_path / "rounds", presets=["slow", "big"], lengths=(128, 256, 512), dtypes=("fp32",),
                            max_step_s=3.0, rounds=3)
    status = {(r["label"], r["seq_len"]): r for r in res["rows"]}
    assert status[("slow fp32", 256)]["status"] == "ok" and status[("slow fp32", 256)]["step_s_rounds"] == [4.0] * 3
    assert status[("slow fp32", 512)]["status"].startswith("skipped")
    assert status[("big fp32", 256)]["status"].startswith("failed") and calls.count(("big", 256, "fp32")) == 1

    def oom_for(victim):
        def fake_oom(preset, T, **kw):
            if preset == victim:
                raise MemoryError()
            return fake(preset, T, **kw)
        return fake_oom

    monkeypatch.setattr(suite, "train_step_throughput", oom_for("vanilla-lm"))
    res = suite.bench_train(tmp_path / "b", presets=["t2-lm", "vanilla-lm"], lengths=(128,), dtypes=("fp32",))
    assert any(v.startswith("FAIL  t2-lm vs vanilla-lm fp32 T=128: not measured (vanilla-lm: failed: out of memory")
               for v in res["verdicts"])
    monkeypatch.setattr(suite, "train_step_throughput", oom_for("t2-lm"))
    res = suite.bench_train(tmp_path / "c", presets=["t2-lm", "vanilla-lm"], lengths=(128,), dtypes=("fp32",))
    assert any(v.startswith("FAIL  t2-lm MFU fp32 T=128: not measured") for v in res["verdicts"])

    def bug(preset, T, **kw):
        raise RuntimeError("shape mismatch")  # not a resource limit: surfaces

    monkeypatch.setattr(suite, "train_step_throughput", bug)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        suite.bench_train(tmp_path / "d", presets=["t2-lm"], lengths=(128,), dtypes=("fp32",))
    for bad in ({"lengths": ()}, {"lengths": (0, 128)}, {"max_step_s": 0}):
        with pytest.raises(ValueError):
            suite.bench_train(tmp_path / "e", presets=["t2-lm"], **{"lengths": (128,), **bad})


def test_a_memory_cap_turns_a_configuration_too_large_into_an_error():
    from transnormer.bench.suite import _did_not_fit
    from transnormer.bench.train_step import train_step_throughput

    # a step at 16k tokens peaks at ~1.7 GB resident (at 8k ~1.15 GB: too close to the 1.5 GB cap on address
    # space to fail every time)
    with pytest.raises(RuntimeError, match="can't allocate memory") as e:
        train_step_throughput("t2-lm-tiny", 16384, tokens_per_step=16384, steps=1, max_mem_gb=1.5)
    assert _did_not_fit(e.value).startswith("out of memory")
    row = train_step_throughput("t2-lm-tiny", 64, tokens_per_step=64, vocab_size=128, steps=1, max_mem_gb=3)
    assert row["finite"]
    assert _did_not_fit(ImportError("libtorch_cpu.so: failed to map segment from shared object")).startswith("out of")
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        train_step_throughput("t2-lm-tiny", 64, steps=0)
    for bad in (0, -1.0, True, "2"):
        with pytest.raises(ValueError, match="max_mem_gb"):
            train_step_throughput("t2-lm-tiny", 64, max_mem_gb=bad)
    with pytest.raises(ValueError, match="isolate"):
        train_step_throughput("t2-lm-tiny", 64, max_mem_gb=2, isolate=False)


def test_only_a_killed_child_counts_as_out_of_memory():
    # every child death used to read as "out of memory" (the message names -9), ending the sweep
    from transnormer.bench.suite import _did_not_fit

    def died(code):
        return RuntimeError(f"_measure died in its fresh process (exit code {code}) before returning; a negative "
                            "code is the signal that killed it (-9: out of memory, most likely)")

    assert _did_not_fit(died(-9)).startswith("_measure died in its fresh process (exit code -9)")
    assert _did_not_fit(died(-11)) is None  # a crash is a bug to surface, not a row


def test_bench_refuses_bidirectional_presets():
    from transnormer.bench.train_step import build_bench_model

    with pytest.raises(ValueError, match="bidirectional"):
        build_bench_model("t2-roberta-tiny", 64, 100, {})


def test_bench_small_pieces():
    from transnormer.bench.report import markdown_table
    from transnormer.bench.timing import measure

    assert "1,000" in markdown_table([{"v": 999.7}], ["v"])  # not 1e+03
    assert markdown_table([{"a": 1, "engine": None}], ["a", "engine"]).splitlines()[-1] == "| 1 |  |"  # not "None"
    with pytest.raises(ValueError, match="repeat must be an int >= 1"):
        measure(lambda: None, repeat=0)


def test_memory_target_per_dtype(monkeypatch, tmp_path):
    from transnormer.bench import suite

    def fake(preset, T, *, dtype, **kw):
        return {"seq_len": T, "peak_mem_mb": T / 1000 + (1.0 if dtype == "fp32" else 10.0), "step_s": 1.0}

    monkeypatch.setattr(suite, "train_step_throughput", fake)
    res = suite.bench_memory(tmp_path, lengths=(4096, 16384))
    assert [v.split()[2] for v in res["verdicts"]] == ["fp32", "fp32", "bf16", "bf16"]
    assert all(v.startswith("PASS") for v in res["verdicts"])

    def quadratic(preset, T, *, dtype, **kw):  # 800 MB fixed + T²/1e6 MB: passes the ratio alone
        return {"seq_len": T, "peak_mem_mb": 800 + T * T / 1e6, "step_s": 1.0}

    monkeypatch.setattr(suite, "train_step_throughput", quadratic)
    res = suite.bench_memory(tmp_path, lengths=(4096, 16384), dtypes=("fp32",))
    assert res["verdicts"][0].startswith("PASS") and res["verdicts"][1].startswith("FAIL")
    monkeypatch.setattr(suite, "train_step_throughput", fake)
    # lengths sorted (given longest first they had been judged "4096 / 16384 = 0.43x, target <= 0.3x")
    res = suite.bench_memory(tmp_path, lengths=(16384, 4096), dtypes=("fp32",))
    assert "peak memory 16384 / 4096" in res["verdicts"][0] and res["verdicts"][0].startswith("PASS")
    for lengths in ((1, 4), (4096,)):  # T = 1 had divided by zero above its T/8 base
        with pytest.raises(ValueError, match="lengths must hold two or more lengths, the shortest >= 2"):
            suite.bench_memory(tmp_path, lengths=lengths)


@pytest.mark.parametrize("part", ["bench_ops", "bench_train", "bench_memory", "bench_peers"])
def test_the_bench_functions_refuse_an_unknown_dtype_by_name(part, monkeypatch, tmp_path):
    # a bare KeyError 'fp16' (in bench_peers after its three FLOP counts had run)
    from transnormer.bench import suite

    monkeypatch.setattr(suite, "counted_step_flops", lambda *a, **k: pytest.fail("counted before the check"))
    monkeypatch.setattr(suite, "_import_peer", lambda *a, **k: None, raising=False)
    with pytest.raises(ValueError, match=r"dtypes must be a non-empty sequence of \['bf16', 'fp32'\], got"):
        getattr(suite, part)(tmp_path, dtypes=("fp16",))


def test_bench_long_does_not_say_it_measures_fp32_only(monkeypatch, tmp_path, capsys):
    # on a CPU without bf16 products it had printed "measuring fp32 only", then run its bf16 step
    from transnormer.bench import suite, timing
    from transnormer.cli import main

    asked = []
    monkeypatch.setattr(timing, "cpu_has_bf16_products", lambda: False)
    monkeypatch.setattr(suite, "bench_long", lambda out, **kw: asked.append(kw) or {"verdicts": [], "files": [], "table": ""})
    main(["bench", "long", "--out", str(tmp_path / "long")])
    out = capsys.readouterr().out
    assert asked and "fp32 only" not in out and "the bf16 step runs on PyTorch's slow fallback" in out


def test_the_ideal_counts_the_kernels_recompute_in_the_mixers_only():
    """With recompute, a softmax mixer's backward is 2.5x its forward (FlashAttention-2's five
    products for two) and the causal linear-attention kernel's 2.5x (states) and 3x (score tiles);
    the dense layers and the head keep the 3x convention. Without, everything is 3x."""
    from types import SimpleNamespace

    from transnormer.bench.train_step import model_flops_per_token

    d, h, T, c, w, V = 64, 4, 256, 16, 32, 100
    base = dict(hidden_size=d, num_attention_heads=h, num_hidden_layers=1, ffn_type="glu", ffn_hidden_size=96,
                chunk_size=c, block_size=w, vocab_size=V, causal=True, options_for=lambda t: {})
    dense = 3 * (2 * (4 * d * d + 3 * d * 96) + 2 * d * V)
    e = d // h
    fwd = {"softmax": 2 * T * d, "diag": 2 * w * d, "norm": (4 * d * e, 2 * c * d)}
    for t in ("softmax", "diag", "norm"):
        cfg = SimpleNamespace(layer_types=[t], **base)
        plain, executed = model_flops_per_token(cfg, T), model_flops_per_token(cfg, T, recompute=True)
        if t == "norm":
            states, tiles = fwd[t]
            assert plain == dense + 3 * (states + tiles)
            assert executed == dense + 3.5 * states + 4 * tiles
        else:
            assert plain == dense + 3 * fwd[t] and executed == dense + 3.5 * fwd[t]


def test_bench_ops_keeps_each_configurations_median_round(monkeypatch, tmp_path):
    from transnormer.bench import suite

    calls = []
    slow = {(True, 64): [1.0, 3.0, 2.0], (False, 64): [5.0, 4.0, 6.0]}  # seconds by round

    def fake(T, *, causal, dtype, chunk):
        calls.append((causal, T))
        s = slow[(causal, T)][sum(c == (causal, T) for c in calls) - 1]
        return {"T": T, "causal": causal, "seconds": s, "backend": "native", "engine": None,
                "gflops": 100.0 / s, "useful_gflops": 50.0 / s}

    monkeypatch.setattr(suite, "op_throughput", fake)
    shapes = iter([50.0, 80.0, 70.0, 60.0, 100.0, 90.0])  # causal, bidir probes in rounds 1, 2, 3
    monkeypatch.setattr(suite, "same_shape_gemm_gflops", lambda *a, **k: next(shapes))
    probes = iter([80.0, 100.0, 90.0])  # the GEMM probe takes its turn each round; the fastest is the limit
    monkeypatch.setattr(suite, "gemm_gflops", lambda *a, **k: calls.append("gemm") or next(probes))
    res = suite.bench_ops(tmp_path, lengths=(64,), dtypes=("fp32",), rounds=3)
    assert calls == ["gemm", (True, 64), (False, 64)] * 3  # in turn, round by round
    causal, bidir = res["rows"]
    assert (causal["step_s"], causal["step_s_rounds"]) == (2.0, [1.0, 3.0, 2.0])
    assert (bidir["step_s"], bidir["gemm_square"], bidir["frac_square"]) == (5.0, pytest.approx(100.0), pytest.approx(0.2))
    assert (causal["gemm_same_shape"], bidir["gemm_same_shape"]) == (pytest.approx(100.0), pytest.approx(90.0))
    assert res["verdicts"][-1].startswith("SKIP  op targets: they are set at T >= 4096")  # T = 64 alone
    with pytest.raises(ValueError, match="rounds"):
        suite.bench_ops(tmp_path, lengths=(64,), dtypes=("fp32",), rounds=0)


def test_train_and_peer_limits_are_the_faster_of_two_probes(monkeypatch, tmp_path):
    """One probe at the start of an hour-long sweep could fall in a slow spell and inflate every
    MFU: the GEMM is probed before and after each dtype's sweep and the faster kept."""
    from transnormer.bench import suite

    def fake(preset, T, **kw):
        return {"preset": preset, "seq_len": T, "batch": 1, "dtype": kw["dtype"], "step_s": 1.0,
                "tokens_per_s": float(T), "peak_mem_mb": 1.0}

    probes = iter([100.0, 250.0])
    monkeypatch.setattr(suite, "train_step_throughput", fake)
    monkeypatch.setattr(suite, "gemm_gflops", lambda *a, **k: next(probes))
    res = suite.bench_train(tmp_path, presets=["t2-lm", "vanilla-lm"], lengths=(128,), dtypes=("fp32",))
    (row,) = [r for r in res["rows"] if r["preset"] == "t2-lm"]
    assert row["mfu"] == pytest.approx(row["model_gflops"] / 250.0)
    (mfu,) = [v for v in res["verdicts"] if "MFU" in v]
    assert "of 250 GFLOP/s GEMM" in mfu
    # both probes reported: far apart, the machine's speed changed under the sweep
    assert "probed 100 before the sweep, 250 after" in mfu
    saved = json.loads((tmp_path / "train.json").read_text())
    assert saved["gemm_probes_gflops"] == {"fp32": [100.0, 250.0]}
    # what the step times depend on, recorded (the LM head's vocabulary had been in no report)
    assert saved["settings"] == {"vocab_size": 32768, "tokens_per_step": 16384, "steps": 2, "rounds": 1}


def test_a_non_finite_long_step_is_strict_json(monkeypatch, tmp_path):
    from transnormer.bench import suite

    nan = float("nan")
    monkeypatch.setattr(suite, "train_step_throughput", lambda *a, **k: {
        "seq_len": 65536, "dtype": "bf16", "loss": nan, "step_s": 1.0, "peak_mem_mb": 1.0, "warmup_steps": 2,
        "finite": False, "loss_finite": False, "grads_finite": True, "params_finite": True})
    res = suite.bench_long(tmp_path)
    assert res["verdicts"][0].startswith("FAIL")
    text = (tmp_path / "long.json").read_text()
    assert "NaN" not in text  # a bare NaN, which strict JSON parsers refuse, where bench long is needed most
    saved = json.loads(text)
    assert saved["results"][0]["loss"] is None and saved["settings"]["vocab_size"] == 8192


def test_peer_verdicts_report_both_gemm_probes(monkeypatch, tmp_path):
    from transnormer.bench import peers, suite

    def fake(preset, T, **kw):
        return {"preset": preset, "seq_len": T, "step_s": 1.0, "tokens_per_s": float(T), "params": 1e6,
                "peak_mem_mb": 1.0}

    probes = iter([300.0, 200.0])
    monkeypatch.setattr(suite, "train_step_throughput", fake)
    monkeypatch.setattr(suite, "counted_step_flops", lambda p, T, **kw: 1e9)
    monkeypatch.setattr(suite, "gemm_gflops", lambda *a, **k: next(probes))
    monkeypatch.setattr(suite, "_peer_output_verdict", lambda: "PASS  outputs")
    monkeypatch.setattr(peers, "_import_peer", lambda name: None)
    monkeypatch.setattr(peers, "peer_versions", lambda: {})
    res = suite.bench_peers(tmp_path, dtypes=("bf16",), rounds=1)
    speed_verdicts = res["verdicts"][1:]  # flash-lm's and t2-lm's
    assert len(speed_verdicts) == 2 and all(
        "of the 300 GFLOP/s GEMM" in v and "probed 300 before the sweep, 200 after" in v for v in speed_verdicts)
    assert json.loads((tmp_path / "peers.json").read_text())["gemm_probes_gflops"] == {"bf16": [300.0, 200.0]}


def test_bench_peers_alternates_its_rounds(monkeypatch, tmp_path):
    """The >= 2x verdict came from one step run of each model, one after the other; with rounds the
    three alternate and each keeps its median round."""
    from transnormer.bench import peers, suite

    calls = []
    times = {"flash-lm": iter([1.0, 9.0, 1.1]), "t2-lm": iter([0.8, 0.9, 7.0]), "peer:flash-pytorch": iter([2.4, 2.5, 2.6])}

    def fake(preset, T, **kw):
        calls.append(preset)
        t = next(times[preset])
        return {"preset": preset, "seq_len": T, "step_s": t, "tokens_per_s": T / t, "params": 1e6, "peak_mem_mb": 1.0}

    monkeypatch.setattr(suite, "train_step_throughput", fake)
    monkeypatch.setattr(suite, "counted_step_flops", lambda p, T, **kw: 1e9)
    monkeypatch.setattr(suite, "gemm_gflops", lambda *a, **k: 100.0)
    monkeypatch.setattr(suite, "_peer_output_verdict", lambda: "PASS  outputs")
    monkeypatch.setattr(peers, "_import_peer", lambda name: None)
    monkeypatch.setattr(peers, "peer_versions", lambda: {})
    res = suite.bench_peers(tmp_path, dtypes=("bf16",), rounds=3)
    assert calls == ["flash-lm", "t2-lm", "peer:flash-pytorch"] * 3
    ratio = {r["preset"]: r["vs_peer"] for r in res["rows"]}
    assert ratio["flash-lm"] == pytest.approx(2.5 / 1.1) and ratio["t2-lm"] == pytest.approx(2.5 / 0.9)
    assert [v[:4] for v in res["verdicts"][1:]] == ["PASS", "PASS"]


@pytest.mark.parametrize("bf16_products", [True, False])
def test_bench_measures_bf16_by_default_only_where_the_cpu_multiplies_it(monkeypatch, tmp_path, capsys,
                                                                         bf16_products):
    """Without AVX512-BF16 or AMX, PyTorch's bf16 matmul is a fallback hundreds of times slower than
    fp32: `bench all` measures fp32 alone there (and skips the bf16-only long step, saying so);
    --dtypes bf16 still insists."""
    import transnormer.cli_bench as cli_bench
    from transnormer.bench import suite, timing
    from transnormer.cli import main

    seen = {}

    def part(name):
        def run(out, **kw):
            seen[name] = kw.get("dtypes")
            return {"rows": [], "verdicts": [], "files": []}
        return run

    for name in ("ops", "train", "memory", "long", "peers"):
        monkeypatch.setattr(suite, f"bench_{name}", part(name))
    monkeypatch.setattr(cli_bench, "_print", lambda res: None)
    monkeypatch.setattr(cli_bench, "_peer_for_bench_peers", lambda: None)  # (flash-pytorch is an optional extra)
    monkeypatch.setattr(timing, "cpu_has_bf16_products", lambda: bf16_products)
    assert main(["bench", "all", "--out", str(tmp_path / "a")]) == 0
    want = ["fp32", "bf16"] if bf16_products else ["fp32"]
    assert seen == {"ops": want, "train": want, "memory": want, "peers": want, **({"long": None} if bf16_products else {})}
    assert ("SKIP  long" in capsys.readouterr().out) is not bf16_products
    seen.clear()
    assert main(["bench", "ops", "--dtypes", "bf16", "--out", str(tmp_path / "b")]) == 0
    assert seen == {"ops": ["bf16"]}


def test_a_step_with_nan_gradients_is_not_finite(monkeypatch):
    # bench long had judged the loss alone: a NaN gradient of its last step went unseen
    from transnormer.bench import train_step

    build = train_step.build_bench_model

    def poisoned(*args):
        model = build(*args)
        next(model.parameters()).register_hook(lambda g: g * float("nan"))
        return model

    monkeypatch.setattr(train_step, "build_bench_model", poisoned)
    row = train_step.train_step_throughput("t2-lm-tiny", 32, tokens_per_step=32, vocab_size=64, steps=1,
                                           isolate=False)
    assert not row["grads_finite"] and not row["params_finite"] and not row["finite"]
    monkeypatch.setattr(train_step, "build_bench_model", build)
    row = train_step.train_step_throughput("t2-lm-tiny", 32, tokens_per_step=32, vocab_size=64, steps=1,
                                           isolate=False)
    assert row["loss_finite"] and row["grads_finite"] and row["params_finite"] and row["finite"]


@pytest.mark.parametrize("kw, match", [({"dtype": "fp16"}, "dtype must be 'fp32' or 'bf16'"),
                                       ({"mode": "training"}, "mode must be 'train' or 'infer'"),
                                       ({"seq_len": 0}, "seq_len must be an int >= 1"),
                                       ({"tokens_per_step": -8}, "tokens_per_step must be an int >= 1")])
def test_train_step_throughput_refuses_what_it_would_mislabel(kw, match):
    # fp16 had been measured as fp32, and "training" as a no-grad forward, each under the name given
    from transnormer.bench import suite
    from transnormer.bench.train_step import train_step_throughput

    args = {"seq_len": 64, **kw}
    with pytest.raises(ValueError, match=match):
        train_step_throughput("t2-lm-tiny", args.pop("seq_len"), isolate=False, **args)
    if "mode" in kw:
        with pytest.raises(ValueError, match=match):
            suite.bench_train("unused", mode=kw["mode"])
