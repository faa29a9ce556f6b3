"""Process-level settings used by the CLI and the benchmarks: the allocator, fresh-process calls."""

import os
import subprocess
import sys

import pytest
import torch


def _run(env_extra):
    code = ("import ctypes.util; from transnormer.runtime import tune_allocator; "
            "print(tune_allocator(), tune_allocator(), bool(ctypes.util.find_library('c')))")
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()


def test_applied_once_on_glibc_and_idempotent():
    first, second, has_libc = _run({})
    if has_libc == "True" and sys.platform.startswith("linux"):
        assert first == second == "True"


def test_opt_out():
    assert _run({"TRANSNORMER_MALLOC": "default"})[:2] == ["False", "False"]


def _pid_and(x, *, y=0):
    if x < 0:
        raise ValueError("x must be >= 0")
    if x == 99:
        os._exit(3)  # dies without a word, as a process killed for memory would
    from transnormer import runtime

    return os.getpid(), x + y, runtime._done  # _done: None until tune_allocator has run


def _threads():
    return torch.get_num_threads()


def _unpicklable():
    return lambda: None


class _NeedsTwo(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")  # (its args are one string: unpickling calls _NeedsTwo(str))


def _raise_needs_two():
    raise _NeedsTwo(1, 2)


def test_call_in_fresh_process_keeps_the_threads_and_says_what_could_not_come_back():
    """The child had every core whatever the parent's threads (TRANSNORMER_THREADS did not reach
    compare's runs); an error that cannot be unpickled raised the unpickling error in its place, and
    an unpicklable result came back as its repr alone."""
    from transnormer.runtime import call_in_fresh_process

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert call_in_fresh_process(_threads) == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match=r"_raise_needs_two could not send back its error \(_NeedsTwo: 1 and 2\)"):
        call_in_fresh_process(_raise_needs_two)
    with pytest.raises(RuntimeError, match=r"_unpicklable could not send back its result: \w+Error"):
        call_in_fresh_process(_unpicklable)


def _semaphores() -> int:
    return len([f for f in os.listdir("/dev/shm") if f.startswith("sem.")]) if os.path.isdir("/dev/shm") else 0


def test_call_in_fresh_process_returns_raises_and_reports_a_dead_child():
    import multiprocessing

    import pytest

    from transnormer.runtime import call_in_fresh_process

    sems = _semaphores()
    pid, total, tuned = call_in_fresh_process(_pid_and, 2, y=3)
    assert pid != os.getpid() and total == 5
    assert tuned is not None  # the child ran the allocator setting first
    with pytest.raises(ValueError, match="x must be") as err:
        call_in_fresh_process(_pid_and, -1)
    assert any("in the fresh process" in n and "_pid_and" in n for n in err.value.__notes__)  # the child's traceback
    with pytest.raises(RuntimeError, match="died in its fresh process.*exit code 3"):
        call_in_fresh_process(_pid_and, 99)  # a multiprocessing.Pool would wait forever here
    assert multiprocessing.active_children() == []
    assert _semaphores() == sems  # no named semaphores left behind (the resource tracker's "leaked" warning)


def test_threads_from_env_sets_every_commands_threads(monkeypatch, capsys):
    """README: TRANSNORMER_THREADS sets the threads of training too; nothing had read it there."""
    import torch

    from transnormer.cli import main
    from transnormer.runtime import threads_from_env

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("TRANSNORMER_THREADS", raising=False)
        assert threads_from_env() is None and torch.get_num_threads() == before
        monkeypatch.setenv("TRANSNORMER_THREADS", "1")
        assert threads_from_env() == 1 and torch.get_num_threads() == 1
        for bad in ("0", "two", "-1", "99999999999999999999"):  # (the last: torch's "Overflow when unpacking")
            monkeypatch.setenv("TRANSNORMER_THREADS", bad)
            with pytest.raises(ValueError, match="TRANSNORMER_THREADS must be a whole number"):
                threads_from_env()
        assert main(["generate", "--model", "t2-lm-tiny", "--prompt", "x"]) == 2  # refused before any work
        assert "TRANSNORMER_THREADS" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


def test_bf16_autocast_on_a_cpu_without_bf16_products_warns(monkeypatch):
    """PyTorch's CPU bf16 matmul without AVX512-BF16 or AMX ran at 0.3 GFLOP/s (fp32: 168) on an
    AVX2 machine: asking for bf16 there must say so, and fp32 must not warn."""
    import warnings

    import transnormer.train.loop as loop

    cpu = torch.device("cpu")
    monkeypatch.setattr(loop, "cpu_has_bf16_products", lambda: False)
    with pytest.warns(UserWarning, match="without AVX512-BF16 or AMX.*fp32"):
        loop.autocast_factory(cpu, "bf16")
    monkeypatch.setattr(loop, "cpu_has_bf16_products", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop.autocast_factory(cpu, "bf16")
        loop.autocast_factory(cpu, "fp32")
    monkeypatch.setattr(loop, "cpu_has_bf16_products", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop.autocast_factory(cpu, "fp32")


def test_reset_peak_rss_starts_this_runs_peak_again():
    # compare under torchrun trains its presets in one process: each had reported the largest peak so far
    import mmap

    from transnormer.runtime import peak_rss_mb, reset_peak_rss

    big = mmap.mmap(-1, 64 * 2**20)  # 64 MiB touched, then unmapped (whatever the allocator keeps)
    big.write(b"x" * len(big))
    big.close()
    before = peak_rss_mb()
    if not reset_peak_rss():
        pytest.skip("no /proc/self/clear_refs")
    assert peak_rss_mb() < before - 32


@pytest.mark.parametrize("var, value, match", [
    ("TRANSNORMER_FP32_GEMM", "bogus", "TRANSNORMER_FP32_GEMM must be one of"),
    ("TRANSNORMER_NATIVE", "off", "TRANSNORMER_NATIVE must be 0"),
    ("TRANSNORMER_MALLOC", "bogus", "TRANSNORMER_MALLOC must be 'default'"),
])
def test_a_bad_environment_variable_is_refused_before_any_work(tmp_path, monkeypatch, capsys, var, value, match):
    # FP32_GEMM had been found at the first forward, after train had moved --out's earlier run aside;
    # NATIVE=off and MALLOC=bogus had been taken silently
    from transnormer.cli import main

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "summary.json").write_text("{}")
    monkeypatch.setenv(var, value)
    assert main(["train", "--preset", "t2-lm-tiny", "--data", str(tmp_path / "none.txt"), "--max-steps", "1",
                 "--out", str(tmp_path / "run")]) == 2
    assert match in capsys.readouterr().err
    assert (tmp_path / "run" / "summary.json").is_file()  # nothing moved aside


def test_a_bad_native_or_malloc_value_raises_every_time_in_library_use():
    # it had raised once, then the kernels were silently off (and the allocator silently untuned)
    code = ("from transnormer.ops import _native; from transnormer import runtime\n"
            "for f in (_native.load, _native.load, runtime.tune_allocator, runtime.tune_allocator):\n"
            "    try:\n        f(); print('ran')\n    except ValueError:\n        print('refused')\n")
    env = {**os.environ, "TRANSNORMER_NATIVE": "off", "TRANSNORMER_MALLOC": "bogus"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["refused"] * 4


def test_a_model_config_error_names_the_model_not_the_train_flag():
    # --set vocab_size=0 had read "vocab_size (--vocab-size) must ...", the tokenizer's flag
    from transnormer.train import TrainConfig

    with pytest.raises(ValueError) as e:
        TrainConfig(preset="t2-lm-tiny", overrides={"vocab_size": 0}, max_steps=1).check()
    assert "(--vocab-size)" not in str(e.value) and str(e.value).startswith("the model (with --set {'vocab_size': 0}):")


def test_empty_environment_variables_read_as_unset(monkeypatch):
    # TRANSNORMER_THREADS= and TRANSNORMER_MALLOC= were unset; NATIVE= and FP32_GEMM= had been refused
    from transnormer.ops import _native
    from transnormer.runtime import check_env

    for var in ("TRANSNORMER_THREADS", "TRANSNORMER_MALLOC", "TRANSNORMER_NATIVE", "TRANSNORMER_FP32_GEMM"):
        monkeypatch.setenv(var, "")
    check_env()
    assert _native.native_disabled() is False
