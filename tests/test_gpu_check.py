"""The GPU check script (scripts/gpu_check.py) in CI: its ``--dry-run`` on CPU and its no-GPU exit.

The dry run runs every section's code path at tiny sizes (the Triton kernel under
``TRITON_INTERPRET=1``, ``torch.compile`` with the eager backend) in a child process, as a person
would run it, with one thread: about 25 s here.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"


def _load_script():
    return importlib.import_module("scripts.gpu_check")


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _read(path: Path) -> tuple[list[str], list[str], list[dict[str, str]]]:
    """(comment lines, header, rows) of one result CSV."""
    lines = path.read_text().splitlines()
    comments = [line for line in lines if line.startswith("#")]
    reader = csv.DictReader(line for line in lines if not line.startswith("#"))
    return comments, list(reader.fieldnames or []), list(reader)


def test_dry_run_writes_every_section(tmp_path):
    gc = _load_script()
    proc = _run("--dry-run", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "summary" in proc.stdout
    for section in gc.SECTIONS:
        path = tmp_path / f"gpu_{section}.csv"
        assert path.is_file(), f"{section}: no CSV"
        comments, header, rows = _read(path)
        assert comments[0].startswith("# command: python scripts/gpu_check.py --dry-run")
        assert header == ["status", *gc.COLUMNS[section], "error"], section
        assert rows, f"{section}: no rows"
        ran = [r for r in rows if r["status"] == "ok"]
        assert ran, f"{section}: nothing ran: {rows}"
        for r in ran:
            for col in gc.RATIO_COLUMNS.get(section, []):
                assert math.isfinite(float(r[col])), (section, r)
    _, _, tests = _read(tmp_path / "gpu_tests.csv")
    assert int(tests[0]["failed"]) == 0 and int(tests[0]["skipped"]) > 0  # no CUDA: all skip
    _, _, sink = _read(tmp_path / "gpu_sinkhorn.csv")
    assert {r["case"] for r in sink} >= {"naive_eager", "ours_torch", "compile_naive"}
    assert {int(r["n"]) for r in sink} == {4, 8}
    _, _, mhc = _read(tmp_path / "gpu_mhc.csv")
    assert {r["case"] for r in mhc} >= {"plain", "ours", "transformers_deepseek_v4"}
    _, _, comp = _read(tmp_path / "gpu_compress.csv")
    assert [r["case"] for r in comp] == ["plain", "inloop_unicache", "inloop_xkv"]
    _, _, seam = _read(tmp_path / "gpu_seam.csv")
    assert {r["case"] for r in seam} == {
        "plain_causal_sdpa",
        "seam_batched_mask",
        "seam_per_sample",
        "seam_flex",
    }
    flex = next(r for r in seam if r["case"] == "seam_flex")
    assert flex["status"] == "skipped" and "no CPU backward" in flex["note"]  # CUDA: timed
    _, _, serving = _read(tmp_path / "gpu_serving.csv")
    kernel = [r for r in serving if r["kind"] == "kernel"]
    assert {r["case"] for r in kernel} == {"plain_sdpa", "packed_triton", "reference"}
    assert {r["batch_size"] for r in kernel} == {"1", "2"}
    for r in kernel:  # the Triton kernel ran under the interpreter and matched the reference
        if r["case"] == "packed_triton":
            assert r["status"] == "ok" and float(r["note"].split("= ")[1]) <= 1e-4, r
    gen = [r for r in serving if r["kind"] == "generate"]
    assert [r["case"] for r in gen] == ["plain_dynamic_cache", "compressed_packed"] * 2
    assert all(r["status"] == "ok" and float(r["tokens_per_s"]) > 0 for r in gen), gen
    _, _, ret = _read(tmp_path / "gpu_retention.csv")  # the recipe ran: both fine-tunes, 8x
    assert {r["model"] for r in ret} == {"control fine-tune", "compress fine-tune"}
    assert {r["method"] for r in ret} == {"none", "sinks_recent_q4", "snapkv_q4", "retention_q4"}
    assert all(abs(float(r["kv_reduction"]) - 8) < 0.5 for r in ret if r["method"] != "none")


def test_dry_run_refuses_the_committed_results_dir():
    proc = _run("--dry-run", "--out", str(REPO / "scripts" / "results"), "--sections", "seam")
    assert proc.returncode == 2
    assert "must not write into" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_no_gpu_exits_2_with_how_to_dry_run():
    proc = _run()
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "no CUDA device found" in lines[0] and "--dry-run" in lines[0]


def test_a_failing_section_is_a_row_and_the_run_goes_on(tmp_path, monkeypatch):
    gc = _load_script()

    def boom(ctx):
        raise RuntimeError("kernel exploded")

    monkeypatch.setitem(gc.RUNNERS, "seam", boom)
    ctx = gc.SimpleNamespace(out=tmp_path, command="python scripts/gpu_check.py", machine="cpu")
    line = gc.run_section("seam", ctx)
    assert line["status"] == "error" and "kernel exploded" in line["note"]
    _, header, rows = _read(tmp_path / "gpu_seam.csv")
    assert header[0] == "status" and header[-1] == "error"
    assert rows == [
        {**dict.fromkeys(header, ""), "status": "error", "error": "RuntimeError: kernel exploded"}
    ]
