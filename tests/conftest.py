import contextlib
import json

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


# The bf16 kernels' product engines (ops/_native_amx.h). The library is built for this CPU, so it
# holds one: AMX where the CPU has it, else AVX512-BF16. On an AMX CPU the AVX512-BF16 engine is
# also built, as a variant without AMX, so that both are tested wherever the tests run on AMX
# (and the bf16 kernel is ready: the tests' skip mark asks the built library).
NO_BF16_KERNEL = "no bf16 kernel on this machine (needs AMX or AVX512-BF16)"  # the skip reason of bf16 tests
_NO_AMX_FLAGS = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")


def needs_bf16_kernel_mark():
    """The skip mark of the bf16 kernel tests (a function: asking builds the kernel library, which
    only the modules that test it should pay for). The ``bf16_engine`` fixture finds those tests by
    this mark's reason."""
    from transnormer.ops import _native

    return pytest.mark.skipif(not _native.bf16_ready(), reason=NO_BF16_KERNEL)


def bf16_engine_params() -> list[str]:
    from transnormer.ops import _native

    lib = _native.load()
    return ["built", "avx512-bf16-variant"] if lib is not None and lib.tn_bf16_engine() == 1 else ["built"]


def _flags_accepted(flags: tuple[str, ...]) -> bool:
    import subprocess

    from transnormer.ops import _native

    cmd = [*_native._compiler(), "-march=native", *flags, "-x", "c++", "-c", "/dev/null", "-o", "/dev/null"]
    proc = subprocess.run(cmd, capture_output=True)
    return proc.returncode == 0


def pytest_generate_tests(metafunc):
    # parametrised here, only for the modules that use the fixture: building the kernel library
    # to ask for its engine is not a cost of every pytest run
    if "bf16_engine" in metafunc.fixturenames:
        metafunc.parametrize("bf16_engine", bf16_engine_params(), indirect=True)


@pytest.fixture
def bf16_engine(request, monkeypatch):
    """A module with ``pytestmark = pytest.mark.usefixtures("bf16_engine")`` runs every test on each
    bf16 product engine this machine can build: "built" leaves the library as built;
    "avx512-bf16-variant" swaps in the variant for the bf16 tests (those skipped with
    ``NO_BF16_KERNEL`` where there is no kernel) and skips the others, which it would only repeat."""
    from transnormer.ops import _native

    if request.param != "avx512-bf16-variant":
        return request.param
    if not any(m.kwargs.get("reason") == NO_BF16_KERNEL for m in request.node.iter_markers("skipif")):
        pytest.skip("not a bf16-kernel test: the variant changes only the bf16 product engine")
    try:
        lib = _native.load_variant(_NO_AMX_FLAGS)
    except (RuntimeError, OSError) as exc:
        if _flags_accepted(_NO_AMX_FLAGS):  # the compiler takes the flags: the sources do not build
            pytest.fail(f"the AVX512-BF16 engine does not build: {exc}")
        pytest.skip(f"the compiler does not take {' '.join(_NO_AMX_FLAGS)}: {exc}")
    assert lib.tn_bf16_engine() == 2, "the variant without AMX must take the AVX512-BF16 engine"
    monkeypatch.setattr(_native, "_lib", lib)
    monkeypatch.setattr(_native, "_build_flags", {})
    assert _native.bf16_engine() == "avx512-bf16"
    return request.param


@contextlib.contextmanager
def on_threads(n: int):
    """torch's intra-op threads set to ``n`` for the block (e.g. a one-process reference run in the
    test process on one thread, as each rank of a two-process run trains), then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: a second intra-op thread only adds sync overhead on the shared 2-core box."""
    with on_threads(1):
        yield


def on_one_and_two_threads(run):
    """(run() on one thread, run() on two): the kernels split heads or rows over threads and must
    give bitwise the same result."""
    with on_threads(1):
        one = run()
    with on_threads(2):
        two = run()
    return one, two


def model_loss_and_grads(model, ids: torch.Tensor, *, amp: bool):
    """(loss, every parameter gradient flattened into one vector), both fp64, of an LM's loss on
    ids as its own labels, under bf16 CPU autocast when ``amp``."""
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach().double(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).double()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a−b| / max|b| (the spec's tolerance measure)."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.fixture(params=["native", "torch"])
def backend(request):
    """Run a causal norm_linear_attn test on the fused CPU kernel and on the PyTorch form."""
    from transnormer.ops import _native

    if request.param == "native" and _native.load() is None:
        pytest.skip("fused CPU kernel unavailable (no C++ compiler)")
    before = _native.backend()
    _native.set_backend(request.param)
    yield request.param
    _native.set_backend(before)


@pytest.fixture
def native_kernels():
    """The fused CPU kernels wherever they apply: "auto" leaves some to PyTorch on a build without
    AVX-512 (ops/_native.py, rows_usable), and a test of a kernel must still run it there."""
    from transnormer.ops import _native

    if _native.load() is None:
        pytest.skip("fused CPU kernels unavailable (no C++ compiler)")
    before = _native.backend()
    _native.set_backend("native")
    yield
    _native.set_backend(before)


def sharpen_gau(model, beta_std: float | None = None):
    """Unit-scale GAU/FLASH weights: the N(0, 0.02²) init keeps their outputs ~1e-3 of the
    residual, too small for an atol test to see a wrong term; with these every branch moves the
    logits by O(1). ``beta_std`` also redraws the per-head offsets."""
    from transnormer.layers import FLASH, GAU

    torch.manual_seed(1)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, (GAU, FLASH)):
                mod.proj.weight.normal_(0.0, mod.hidden_size ** -0.5)
                mod.out_proj.weight.normal_(0.0, mod.e ** -0.5)
                mod.gamma.normal_(0.0, 1.0)
                if beta_std is not None:
                    mod.beta.normal_(0.0, beta_std)
    return model


# The ranks of run_two_ranks are forked from one server process per test session that has imported
# torch, transformers and the package once (multiprocessing's "forkserver", its modules preloaded):
# a rank started as a fresh interpreter spent ~4-8 s per process importing them on 2 cores, several
# times the tiny training the DDP/FSDP tests run. The server forks before any torch op (no thread
# pool yet); each rank sets its environment, threads and Python/numpy random streams. What a fresh
# interpreter reads only as it starts comes from the server instead (started from the environment
# of the test that first needed it): the hash seed (the same on both ranks), allocator and OpenMP
# variables other than OMP_NUM_THREADS, import-time TORCH_* settings; and a rank ends without
# running atexit handlers. The `..._under_torchrun` tests keep fresh processes for all of that.
_RANK_PRELOAD = ["torch", "torch.distributed", "transnormer.models", "transnormer.train", "transnormer.cli"]
_rank_context = None


def _forked_rank_context():
    global _rank_context
    if _rank_context is None:
        import multiprocessing

        _rank_context = multiprocessing.get_context("forkserver")
        _rank_context.set_forkserver_preload(_RANK_PRELOAD)
    return _rank_context


def _run_as_main(args: list[str], env: dict, log: str) -> None:
    """A rank: ``python *args`` in this forked process, its output to the file ``log``."""
    import os
    import random
    import runpy
    import sys

    import numpy

    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS"):  # read at the server's torch import, not at this fork's start
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    random.seed()  # from the OS, as a fresh interpreter's streams are (forks share the server's)
    numpy.random.seed()
    sys.argv = list(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))  # as `python script` puts it first
    runpy.run_path(args[0], run_name="__main__")


def run_two_ranks(args: list[str], *, env: dict | None = None, timeout: float = 300) -> None:
    """Run the Python script ``args[0]`` (its arguments ``args[1:]``) as ranks 0 and 1 of a
    two-process group on this host, with the environment ``torchrun --standalone --nproc_per_node
    2`` gives its workers (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT:
    all that ``setup_distributed`` reads) added to ``env`` (default: this process's environment
    with OMP_NUM_THREADS=1, one thread per rank, as the two share the cores).

    For the tests of training under DDP/FSDP, whose subject is the training, not the launcher: the
    ranks are forked from a server that has the libraries imported (above), and the tests named
    ``..._under_torchrun`` keep the real launcher (whose agent alone added ~3.5 s a launch). If one
    rank fails the other is killed (it would wait in a collective) and CalledProcessError is raised
    with both ranks' last lines of output attached; on success their output is printed (pytest
    shows it with a failure later in the test, or under -s)."""
    import os
    import socket
    import subprocess
    import sys
    import tempfile
    import time

    with socket.socket() as s:  # a free port, as torchrun --standalone picks one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {**({**os.environ, "OMP_NUM_THREADS": "1"} if env is None else env), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    ctx = _forked_rank_context()
    with tempfile.TemporaryDirectory() as tmp:
        logs = [os.path.join(tmp, f"rank{r}.log") for r in range(2)]
        procs = []
        try:
            for r in range(2):
                open(logs[r], "w").close()
                procs.append(ctx.Process(target=_run_as_main,
                                         args=(args, {**base, "RANK": str(r), "LOCAL_RANK": str(r)}, logs[r])))
                procs[-1].start()
            deadline = time.monotonic() + timeout
            while True:
                codes = [p.exitcode for p in procs]  # every rank looked at (any() would stop at the first running)
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                running = None in codes
                if failed or not running or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:  # none left behind, whatever ended the wait (a Ctrl-C too)
                if p.exitcode is None:
                    p.kill()
                p.join()
        outs = [open(f, errors="replace").read() for f in logs]
    if failed or running:
        err = (subprocess.CalledProcessError(procs[failed[0]].exitcode, args) if failed
               else subprocess.TimeoutExpired(args, timeout))
        for r, out in enumerate(outs):  # both: the root cause is often in the rank that did not fail
            err.add_note(f"--- rank {r} (exit code {procs[r].exitcode}), last lines:\n"
                         + ("\n".join(out.splitlines()[-30:]) or "(none: it failed before its output went to "
                            "its log, e.g. loading conftest in the fork; see the captured stderr of the test "
                            "that started the fork server)"))
        raise err
    for r, out in enumerate(outs):
        sys.stdout.write(f"--- rank {r}:\n{out}")


# Each rank of run_runs_on_two_ranks: the runs in turn in one process, several runs in one group
# made around them (as `compare` and `lra train` make it), a single run in the group it makes (and
# tears down) itself, as under torchrun: one launch and one first-run warm-up for several runs. A run
# that resumes another is a fresh process's work only if its checkpoint came from another launch:
# the tests put such runs in a later launch.
_RUNS_SCRIPT = """\
import json, sys
from transnormer.train.distributed import cleanup, setup_distributed
runs = json.loads(sys.argv[1])
info = setup_distributed("cpu") if len(runs) > 1 else None
for kind, arg in runs:
    if kind == "train":
        from transnormer.train import TrainConfig, train
        train(TrainConfig(**arg))
    else:
        from transnormer.cli import main
        rc = main(arg)
        if rc:
            sys.exit(rc)
if info is not None:
    cleanup(info)
"""


def run_runs_on_two_ranks(tmp_path, runs: list[tuple[str, object]], **kwargs) -> None:
    """Run ``runs`` in turn on ranks 0 and 1 of one two-process launch (:func:`run_two_ranks`, its
    keyword arguments). Each run is ("train", a TrainConfig or its dict) or ("cli", the argv of
    ``transnormer``)."""
    import dataclasses

    script = tmp_path / "runs_on_two_ranks.py"
    script.write_text(_RUNS_SCRIPT)
    spec = [(kind, dataclasses.asdict(arg) if dataclasses.is_dataclass(arg) else arg) for kind, arg in runs]
    kwargs.setdefault("timeout", 300 * len(runs))
    run_two_ranks([str(script), json.dumps(spec)], **kwargs)


CORPUS_WORDS = "the of a linear attention model norm block chunk state token layer kernel value query key".split()


def write_small_corpus(root, docs: int = 300, *, splits=None) -> str:
    """A small generated corpus (``root``/{split}.txt, random sentences of :data:`CORPUS_WORDS`) for
    the tests whose subject is not the data: the default ``stdlib`` corpus takes seconds to extract
    from a fresh cache. ``splits``: (name, documents) pairs, by default train ``docs`` and valid
    ``docs`` / 10 (at least 10)."""
    import random
    from pathlib import Path

    rng = random.Random(0)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for split, n in splits or (("train", docs), ("valid", max(10, docs // 10))):
        text = [" ".join(rng.choice(CORPUS_WORDS) for _ in range(rng.randint(20, 60))) + "." for _ in range(n)]
        (root / f"{split}.txt").write_text("\n\n".join(text))
    return str(root)
