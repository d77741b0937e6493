"""Fault tolerance: killed runs resume exactly, half-written checkpoints are never resumed from,
and a changed world size is reported clearly.

The kill test runs ``fabric run`` with 2 CPU processes under ZeRO stage 2 with everything on
(mHC, compression in the loop, activation checkpointing, bf16 autocast) through
``tests/fabric_driver.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from unicache_train.checkpoint import load_checkpoint
from unicache_train.checkpoint.integrity import write_manifest
from unicache_train.checkpoint.zero import (
    find_resume_checkpoint,
    is_zero_checkpoint,
    publish,
    remove_stale_temporaries,
)
from unicache_train.data.datamodule import LMDataModule, PackedCollator, SeededSampler
from unicache_train.train.config import RunConfig
from unicache_train.train.run import fit, resolve_resume
from unicache_train.train.strategies import CPUDeepSpeedStrategy
from unicache_train.validation import apply_overrides

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "fabric_driver.py"


# ----------------------------------------------------------------------------- single files
def test_sigkill_during_a_checkpoint_write_leaves_the_previous_one_intact(tmp_path):
    """A process SIGKILLed half-way through writing ``last.ckpt`` leaves the old file whole."""
    last = tmp_path / "checkpoints" / "last.ckpt"
    script = textwrap.dedent(f"""
        import os, signal, torch
        from unicache_train.train.strategies import AtomicCheckpointIO
        io = AtomicCheckpointIO()
        io.save_checkpoint({{"global_step": 1, "w": torch.ones(1000)}}, {str(last)!r})
        def half_then_die(obj, f, *a, **k):
            with open(f, "wb") as fh:
                fh.write(b"PK\\x03\\x04" + bytes(1000))  # the first bytes of a torch zip file
                fh.flush(); os.fsync(fh.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save = half_then_die
        io.save_checkpoint({{"global_step": 2, "w": torch.zeros(1000)}}, {str(last)!r})
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert torch.load(last, weights_only=True)["global_step"] == 1  # the complete old one
    assert (tmp_path / "checkpoints" / "last.ckpt.tmp").exists()  # the half-written one
    cfg = RunConfig.from_dict({"train": {"out_dir": str(tmp_path), "resume": "auto"}})
    assert resolve_resume(cfg) == str(last)
    assert not (tmp_path / "checkpoints" / "last.ckpt.tmp").exists()  # cleaned up


def _fake_zero_dir(path: Path, step: int) -> Path:
    (path / "checkpoint").mkdir(parents=True)
    (path / "latest").write_text("checkpoint")
    (path / "checkpoint" / "step.txt").write_text(str(step))
    return path


def test_zero_directory_swap_killed_between_renames_resumes_from_old(tmp_path, monkeypatch):
    ckpts = tmp_path / "checkpoints"
    last = _fake_zero_dir(ckpts / "last.ckpt", 4)
    new = _fake_zero_dir(ckpts / "last.ckpt.tmp", 6)
    real_replace, calls = os.replace, []

    def dies_on_second_rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")  # stands for SIGKILL between the renames
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", dies_on_second_rename)
    with pytest.raises(KeyboardInterrupt):
        publish(new, last)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not last.exists()
    old = find_resume_checkpoint(ckpts)
    assert old == ckpts / "last.ckpt.old" and is_zero_checkpoint(old)
    assert (old / "checkpoint" / "step.txt").read_text() == "4"  # complete and consistent
    assert remove_stale_temporaries(ckpts) == [ckpts / "last.ckpt.tmp"]  # .old is kept
    assert find_resume_checkpoint(ckpts) == old
    publish(_fake_zero_dir(ckpts / "last.ckpt.tmp", 8), last)  # the next save heals it all
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt"]
    assert (last / "checkpoint" / "step.txt").read_text() == "8"


def test_resume_of_a_zero_checkpoint_on_another_world_size_is_a_clear_error(tmp_path):
    """When re-sharding is impossible (here the shards are empty files, so the conversion to a
    universal checkpoint fails), the message names both world sizes."""
    ckpt = _fake_zero_dir(tmp_path / "last.ckpt", 4)
    for rank in range(2):
        (ckpt / "checkpoint" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").touch()
    strategy = CPUDeepSpeedStrategy(config={"zero_optimization": {"stage": 2}})
    strategy.parallel_devices = [torch.device("cpu")]  # a 1-process run
    with pytest.raises(RuntimeError, match="sharded over 2 ranks; this run has 1"):
        strategy.load_checkpoint(ckpt)


def test_world_size_change_on_resume_warns(tmp_path):
    """A checkpoint written by 2 ranks resumed by 1: the module and the data loader say so."""
    args = [
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "model.num_hidden_layers=1",
        "data.seq_len=32",
        "data.batch_size=2",
        "data.synthetic.num_stories=20",
        "data.synthetic.num_recall=20",
        "train.warmup_steps=0",
        "train.limit_val_batches=0",
        "train.checkpoint_every_n_steps=2",
        "train.progress_bar=false",
        "train.accelerator=cpu",
        "logging.logger=none",
        f"train.out_dir={tmp_path}",
        "train.resume=auto",
    ]
    fit(RunConfig.from_dict(apply_overrides({}, [*args, "train.max_steps=2"])))
    last = tmp_path / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=True)
    ckpt["world_size"] = 2  # as if 2 ranks had written it (the same per-rank batch)
    ckpt["global_batch"] = 4
    torch.save(ckpt, last)
    write_manifest(last)  # a deliberate edit, not corruption (which resume would skip)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(RunConfig.from_dict(apply_overrides({}, [*args, "train.max_steps=3"])))
    assert trainer.global_step == 3
    messages = [str(w.message) for w in caught]
    assert any("written with world_size=2 on world_size=1" in m for m in messages), messages


# ----------------------------------------------------------------------------- 2 processes
KILL_ARGS = [
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.residual_mode=mhc",
    "model.hc_mult=4",
    "compress.enabled=true",
    "data.seq_len=64",
    "data.batch_size=4",
    "data.synthetic.num_stories=60",
    "data.synthetic.num_recall=60",
    "train.max_steps=8",
    "train.warmup_steps=2",
    "train.checkpoint_every_n_steps=2",
    "train.limit_val_batches=0",
    "train.val_every_n_steps=8",
    "train.progress_bar=false",
    "train.log_every_n_steps=1",
    "train.accelerator=cpu",
    "train.activation_checkpointing=true",
    "train.resume=auto",
    "logging.logger=none",
]


def expected_batches(args: list[str], world_size: int, steps: int) -> dict[tuple[int, int], str]:
    """(rank, step) -> fingerprint of the batch an uninterrupted run trains there."""
    from fabric_driver import batch_fingerprint

    config = RunConfig.from_dict(apply_overrides({}, args))
    dm = LMDataModule(config.data)
    dm.setup()
    out = {}
    for rank in range(world_size):
        sampler = SeededSampler(
            dm.train_dataset, config.data.seed, num_replicas=world_size, rank=rank
        )
        loader = DataLoader(
            dm.train_dataset,
            batch_size=config.data.batch_size,
            sampler=sampler,
            collate_fn=PackedCollator(),
        )
        for step, batch in zip(range(steps), loader):
            out[(rank, step)] = batch_fingerprint(batch["input_ids"])
    return out


def _launch(record: Path, args: list[str]) -> subprocess.CompletedProcess:
    fabric = Path(sys.executable).with_name("fabric")
    return subprocess.run(
        [
            str(fabric),
            "run",
            "--accelerator",
            "cpu",
            "--devices",
            "2",
            "--strategy",
            "deepspeed_stage_2",
            "--precision",
            "bf16-mixed",
            str(DRIVER),
            str(record),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _rows(record: Path) -> dict[tuple[int, int], dict]:
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    return {(r["rank"], r["step"]): r for r in rows}


def test_sigkill_of_a_rank_mid_checkpoint_then_resume_auto(tmp_path):
    """Rank 1 dies (SIGKILL) half-way through writing its shard of the step-6 checkpoint; the
    restarted run resumes from step 4 with the exact data order and finishes."""
    args = [*KILL_ARGS, f"train.out_dir={tmp_path / 'run'}"]
    ckpts = tmp_path / "run" / "checkpoints"

    first = _launch(tmp_path / "first.jsonl", ["--kill-in-save", "6", *args])
    assert first.returncode != 0
    assert "SIGKILL" in first.stdout + first.stderr
    half = ckpts / "step000006.ckpt.tmp"
    assert half.is_dir()  # what the dead rank left: a half-written shard under a temp name
    assert not (ckpts / "step000006.ckpt").exists()
    assert (
        torch.load(
            ckpts / "last.ckpt" / "checkpoint" / "mp_rank_00_model_states.pt", weights_only=True
        )["global_step"]
        == 4
    )

    second = _launch(tmp_path / "second.jsonl", args)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    assert "left half-written by an interrupted run" in second.stdout + second.stderr

    # Data order: the killed run trained steps 0-5, the resumed one 4-7, every batch the one an
    # uninterrupted run trains at that step and rank (nothing lost, nothing repeated).
    expected = expected_batches(args, world_size=2, steps=8)
    a, b = _rows(tmp_path / "first.jsonl"), _rows(tmp_path / "second.jsonl")
    assert sorted({s for _, s in a}) == list(range(6))
    assert sorted({s for _, s in b}) == list(range(4, 8))
    for rows in (a, b):
        for key, row in rows.items():
            assert row["batch"] == expected[key], key
    for key in [(r, s) for r in range(2) for s in (4, 5)]:  # trained twice, from the same state
        assert b[key]["loss"] == pytest.approx(a[key]["loss"], abs=1e-6), key

    # Only complete checkpoints remain, and each of them loads.
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == [
        "last.ckpt",
        "step000002.ckpt",
        "step000004.ckpt",
        "step000006.ckpt",
        "step000008.ckpt",
    ], names
    for name in names:
        model, _ = load_checkpoint(ckpts / name)
        assert model.config.residual_mode == "mhc"
    assert (
        torch.load(
            ckpts / "last.ckpt" / "checkpoint" / "mp_rank_00_model_states.pt", weights_only=True
        )["global_step"]
        == 8
    )
