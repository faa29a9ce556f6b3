"""Process-level settings used by the CLI and the benchmarks: the allocator, fresh-process calls."""

import os
import subprocess
import sys


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
    from transnormer import runtime

    return os.getpid(), x + y, runtime._done  # _done: None until tune_allocator has run


def test_call_in_fresh_process_returns_raises_and_releases_its_pool():
    import multiprocessing
    import threading

    import pytest

    from transnormer.runtime import call_in_fresh_process

    pid, total, tuned = call_in_fresh_process(_pid_and, 2, y=3)
    assert pid != os.getpid() and total == 5
    assert tuned is not None  # the child ran the allocator setting first
    with pytest.raises(ValueError, match="x must be"):
        call_in_fresh_process(_pid_and, -1)
    # closed and joined: no pool worker or handler thread ("Thread-N (_handle_workers)") outlives the call
    assert multiprocessing.active_children() == []
    assert not [t.name for t in threading.enumerate() if "_handle" in t.name]
