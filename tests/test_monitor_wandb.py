"""What an offline W&B run leaves on disk: nested keys read back, complete files when fit()
returns, and W&B offline by default (no WANDB_MODE, no login)."""

from __future__ import annotations

import shutil
from pathlib import Path

from test_monitor import tiny_run

from unicache_train.monitor.wandb_offline import (
    offline_run_finished,
    parse_history,
    read_offline_history,
)
from unicache_train.train.run import fit

# `wandb leet inspect` text of one history record, as wandb 0.31 prints it: an image logged
# under `gain/plot` is one item per field, each keyed by the path (`gain/plot`, field).
_LEET_TEXT = """
# record 3: history
num:  3
history:  {
  item:  {
    nested_key:  "gain/plot"
    nested_key:  "_type"
    value_json:  "\\"images/separated\\""
  }
  item:  {
    nested_key:  "gain/plot"
    nested_key:  "count"
    value_json:  "1"
  }
  item:  {
    nested_key:  "gain/plot"
    nested_key:  "width"
    value_json:  "1210"
  }
  item:  {
    nested_key:  "gain/amax_fwd"
    value_json:  "1.25"
  }
  item:  {
    key:  "_step"
    value_json:  "6"
  }
  step:  {}
}

# record 4: summary
num:  4
summary:  {
  update:  {
    nested_key:  "gain/amax_fwd"
    value_json:  "9.0"
  }
}
"""


def test_nested_keys_come_back_nested():
    rows = parse_history(_LEET_TEXT)
    assert rows == [
        {
            "gain/plot": {"_type": "images/separated", "count": 1, "width": 1210},
            "gain/amax_fwd": 1.25,
            "_step": 6,
        }
    ]


def _snapshot(run_dir: Path, dest: Path) -> Path:
    """Copy the run directory as it is at this instant (what a reader would see now)."""
    return Path(shutil.copytree(run_dir, dest))


def test_fit_returns_with_complete_offline_files(tmp_path):
    # Before the fix about 1 short fit in 8 returned with a 7-byte .wandb file (the W&B
    # service wrote it after fit() returned). A copy taken the instant fit() returns must hold
    # the whole run: every step's train/loss, the gain plot, and the exit record.
    for i in range(5):
        out = tmp_path / f"fit{i}"
        cfg = tiny_run(out, "wandb")
        fit(cfg)
        runs = list((out / "wandb").glob("offline-run-*"))
        assert len(runs) == 1
        snap = _snapshot(runs[0], tmp_path / f"snapshot{i}")
        assert offline_run_finished(snap), f"fit {i}: no exit record when fit() returned"
        rows = read_offline_history(snap)
        losses = [r for r in rows if "train/loss" in r]
        assert len(losses) == cfg.train.max_steps, (i, len(losses), len(rows))
        plots = [r["gain/plot"] for r in rows if "gain/plot" in r]
        assert len(plots) == 1 and isinstance(plots[0], dict) and "_type" in plots[0]
        assert not any(k in r for r in rows for k in ("_type", "count", "width"))


def test_wandb_runs_offline_by_default_without_login(tmp_path, monkeypatch):
    # conftest.py sets WANDB_MODE for every test; here the default path runs as a new user
    # gets it: no WANDB_MODE, no API key, a HOME without credentials, stdin captured by pytest
    # (a login prompt would fail the test instead of waiting).
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / ".netrc"))
    out = tmp_path / "run"
    cfg = tiny_run(out, "wandb")
    assert cfg.logging.wandb_mode == "offline"  # the default, not set by tiny_run
    fit(cfg)
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1
    assert not list((out / "wandb").glob("run-*"))  # nothing online
    assert not (home / ".netrc").exists()
