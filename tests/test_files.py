"""Atomic writes (``transnormer._files``): a write that fails leaves the old file and no debris."""

from __future__ import annotations

import json

import pytest

from transnormer._files import atomic_path, atomic_savefig, atomic_write_text
from transnormer.analysis._io import save_json
from transnormer.bench.report import write_report


def test_failed_write_keeps_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "summary.json"
    atomic_write_text(target, '{"old": 1}\n')
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text('{"new": tor')  # a torn write, then the process is interrupted
        raise RuntimeError("killed")
    assert json.loads(target.read_text()) == {"old": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_atomic_write_creates_parents_and_readable_file(tmp_path):
    target = tmp_path / "a" / "b" / "x.md"
    atomic_write_text(target, "é\n")
    assert target.read_bytes() == "é\n".encode()
    assert target.stat().st_mode & 0o644 == 0o644


def test_atomic_savefig_writes_the_suffix_format(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    fig = Figure()
    fig.subplots().plot([0, 1], [1, 0])
    png = atomic_savefig(fig, tmp_path / "curve.png", dpi=50)
    pdf = atomic_savefig(fig, tmp_path / "curve.pdf")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert pdf.read_bytes()[:5] == b"%PDF-"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.pdf", "curve.png"]


def test_result_writers_leave_only_their_files(tmp_path):
    save_json({"x": float("nan"), "y": [1, 2]}, tmp_path / "analysis.json")
    assert json.loads((tmp_path / "analysis.json").read_text()) == {"x": None, "y": [1, 2]}
    rows = [{"preset": "a", "seq_len": 8, "step_s": 1.0, "peak_mem_mb": 2.0}]
    write_report(rows, tmp_path / "bench", "train", ["preset", "seq_len", "step_s"], plots=())
    assert sorted(p.name for p in (tmp_path / "bench").iterdir()) == ["train.json", "train.md"]
    assert json.loads((tmp_path / "bench" / "train.json").read_text())["results"] == rows
