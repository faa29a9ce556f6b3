"""Process-level allocator setting used by the CLI and the benchmarks."""

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
