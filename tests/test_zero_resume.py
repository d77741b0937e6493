"""A ZeRO checkpoint written by 2 ranks resumes on 1 and on 4 (and stage 3 on 1), continuing the
loss curve of the uninterrupted 2-rank run.

How: DeepSpeed's universal checkpoint (``unicache_train.checkpoint.zero.to_universal_checkpoint``,
loaded by ``AtomicDeepSpeedStrategy`` with ``load_universal`` on) restores the fp32 master
weights, AdamW moments and step, each rank taking its own slice; Lightning restores the loops and
the LR schedule; the data position is a count of samples of the epoch's permutation, which every
world size shards the same way (``LMDataModule.resume_sampler``). The global batch is kept:
2 ranks x 4 sequences = 1 x 8 = 4 x 2.

The fast tests check the data position and the warning logic; the runs (several CPU processes
each, minutes on 2 cores) are ``slow``. The default suite resumes a 2-rank checkpoint on one
process in ``tests/test_multinode.py``.

Tolerances (fp32 everywhere), per step of the continued run vs the uninterrupted one: 1e-4 on
the global loss. What differs is the order of floating-point sums in the gradient all-reduce
(1, 2 or 4 partial sums): observed <= 1e-6 over 4 steps. Resuming with the AdamW moments and
step reset, all else identical, moves the loss by 2.8e-2 one step later; a wrong data position
by ~3e-2 (two halves of a batch differ by that much), so 1e-4 separates them by two orders of
magnitude either way. Probe logits of the final weights: 1e-4 (observed ~1e-6).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from distributed_runs import (
    MODEL,
    fabric_run,
    failure_report,
    mean_losses,
    read_rows,
    run_overrides,
)

from unicache_train.checkpoint import load_checkpoint
from unicache_train.checkpoint.zero import has_universal_checkpoint, zero_world_size
from unicache_train.data.config import DataConfig
from unicache_train.data.datamodule import LMDataModule, SeededSampler
from unicache_train.train.config import RunConfig
from unicache_train.train.module import LMModule
from unicache_train.train.strategies import (
    CPUDeepSpeedStrategy,
    _non_optimizer_state,
    _restore_non_optimizer_state,
)
from unicache_train.validation import apply_overrides

STEPS = 8
RESUME_AT = 4
GLOBAL_BATCH = 8
LOSS_ATOL = 1e-4
LOGITS_ATOL = 1e-4


def overrides(out_dir: Path, world_size: int, *extra: str) -> list[str]:
    return run_overrides(
        out_dir,
        *extra,
        batch_size=GLOBAL_BATCH // world_size,
        steps=STEPS,
        checkpoint_every=RESUME_AT,
    )


# ----------------------------------------------------------------------------- data position
def _global_batches(
    num_train: int, world: int, batch: int, state: dict | None = None, n: int = 3
) -> list[set[int]]:
    """The next ``n`` global batches (sample ids over all ranks) of ``world`` samplers, each
    resumed from ``state`` (a saved ``train_position``) when given."""
    dm = LMDataModule(DataConfig(batch_size=batch, seed=5))
    orders = []
    for rank in range(world):
        sampler = SeededSampler(list(range(num_train)), seed=5, num_replicas=world, rank=rank)
        if state is not None:
            dm.resume_sampler(sampler, state)
        orders.append(list(iter(sampler)))
    return [{i for order in orders for i in order[k * batch : (k + 1) * batch]} for k in range(n)]


@pytest.mark.parametrize("world, batch", [(1, 8), (2, 4), (4, 2)])
def test_data_position_carries_over_to_another_world_size(world, batch):
    """3 batches on 2 ranks x 4, saved; the next global batches on ``world`` x ``batch`` are the
    uninterrupted run's 4th, 5th and 6th."""
    straight = _global_batches(96, world=2, batch=4, n=6)
    state = {"seed": 5, "batch_size": 4, "num_train": 96, "world_size": 2, "epoch": 0, "batches": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an exact position: nothing to warn about
        resumed = _global_batches(96, world=world, batch=batch, state=state)
    assert resumed == straight[3:]
    assert all(len(b) == GLOBAL_BATCH for b in resumed)


def test_data_position_not_divisible_by_the_new_world_size_warns():
    # 2 ranks x 3 sequences x 1 batch = 6 samples done; 4 ranks cannot start at sample 6.
    state = {"seed": 5, "batch_size": 3, "num_train": 96, "world_size": 2, "epoch": 0, "batches": 1}
    dm = LMDataModule(DataConfig(batch_size=3, seed=5))
    sampler = SeededSampler(list(range(96)), seed=5, num_replicas=4, rank=0)
    with pytest.warns(UserWarning, match="after 6 samples .* 2 samples are trained again"):
        dm.resume_sampler(sampler, state)
    full = SeededSampler(list(range(96)), seed=5, num_replicas=4, rank=0)
    assert list(iter(sampler)) == list(iter(full))[1:]  # floor(6 / 4) = 1 sample per rank done


def test_module_warns_only_when_the_global_batch_changes():
    config = RunConfig.from_dict(apply_overrides({}, [*MODEL, "data.batch_size=8"]))
    module = LMModule(config)
    module._trainer = SimpleNamespace(world_size=1)  # a 1-process resume
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module.on_load_checkpoint({"world_size": 2, "global_batch": 8})  # 2 x 4 = 1 x 8
    with pytest.warns(UserWarning, match=r"global batch changes \(16 -> 8 sequences"):
        module.on_load_checkpoint({"world_size": 2, "global_batch": 16})
    with pytest.warns(UserWarning, match=r"global batch changes \(None -> 8"):
        module.on_load_checkpoint({"world_size": 2})  # written before global_batch was saved
    saved: dict = {}
    module.on_save_checkpoint(saved)
    assert saved == {"world_size": 1, "global_batch": 8}


def test_state_outside_the_optimizer_comes_back_from_the_saved_module(tmp_path):
    """A universal load restores what the optimizer holds; frozen parameters and persistent
    buffers (an MoE router bias, a frozen vision tower) come from the saved module state."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.trained = torch.nn.Parameter(torch.zeros(3))
            self.tied = self.trained  # another name of a trained parameter
            self.frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
            self.register_buffer("bias", torch.zeros(4))
            self.register_buffer("scratch", torch.zeros(1), persistent=False)

    assert _non_optimizer_state(Net()) == ["frozen", "bias"]
    universal = tmp_path / "ckpt" / "universal"
    universal.mkdir(parents=True)
    saved = {
        "trained": torch.full((3,), 9.0),
        "frozen": torch.tensor([1.0, 2.0]),
        "bias": torch.arange(4.0),
    }
    torch.save({"module": saved}, universal / "mp_rank_00_model_states.pt")
    net = Net()
    _restore_non_optimizer_state(net, tmp_path / "ckpt")
    assert net.frozen.tolist() == [1.0, 2.0] and net.bias.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert net.trained.tolist() == [0.0] * 3  # the optimizer's: left to the universal loader
    del saved["bias"]
    torch.save({"module": saved}, universal / "mp_rank_00_model_states.pt")
    with pytest.raises(RuntimeError, match="no saved value for \\['bias'\\]"):
        _restore_non_optimizer_state(Net(), tmp_path / "ckpt")


def test_zero3_reshard_of_a_model_with_frozen_parameters_is_refused(tmp_path):
    """Under ZeRO-3 a frozen parameter is partitioned outside the optimizer, and the universal
    checkpoint does not carry it: refused before anything is converted, with a message."""
    strategy = CPUDeepSpeedStrategy(config={"zero_optimization": {"stage": 3}})
    module = torch.nn.Linear(2, 2)
    module.bias.requires_grad_(False)
    strategy._lightning_module = module
    with pytest.raises(RuntimeError, match=r"written by 2 ranks on 1 .* frozen parameters \(bias"):
        strategy._load_resharded(tmp_path / "step000004.ckpt", saved=2)
    assert list(tmp_path.iterdir()) == []  # nothing converted


# ----------------------------------------------------------------------------- runs (slow)
def _run(devices: int, out: Path, *extra: str, strategy: str = "deepspeed_stage_2") -> Path:
    record = out / "record.jsonl"
    proc = fabric_run(devices, record, overrides(out / "run", devices, *extra), strategy)
    assert proc.returncode == 0, failure_report(proc)
    return record


def _probe_logits(ckpt: Path) -> torch.Tensor:
    model, _ = load_checkpoint(ckpt)
    ids = torch.randint(0, 260, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


def _check_continues(straight: dict, out: Path, world: int) -> dict[int, float]:
    """The resumed run on ``world`` ranks in ``out`` against the uninterrupted one."""
    record = out / "record.jsonl"
    rows = read_rows(record)
    assert sorted(rows) == list(range(RESUME_AT, STEPS))  # no step repeated, none skipped
    for step, ranks in rows.items():
        assert len({r["weights"] for r in ranks.values()}) == 1, step  # ranks in lockstep
    resumed = mean_losses(record, world_size=world)
    for step in resumed:
        assert abs(resumed[step] - straight["losses"][step]) <= LOSS_ATOL, (
            step,
            resumed,
            straight["losses"],
        )
    torch.testing.assert_close(
        _probe_logits(out / "run" / "checkpoints" / "last.ckpt"),
        straight["logits"],
        rtol=0,
        atol=LOGITS_ATOL,
    )
    return resumed


@pytest.fixture(scope="module")
def straight_zero2(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("straight_zero2")
    record = _run(2, out)
    ckpts = out / "run" / "checkpoints"
    return {
        "start": ckpts / f"step{RESUME_AT:06d}.ckpt",
        "losses": mean_losses(record, 2),
        "logits": _probe_logits(ckpts / "last.ckpt"),
    }


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 4])
def test_zero2_checkpoint_of_2_ranks_resumes_on(world, straight_zero2, tmp_path):
    start = straight_zero2["start"]
    _run(world, tmp_path, f"train.resume={start}")
    _check_continues(straight_zero2, tmp_path, world)
    assert has_universal_checkpoint(start) and zero_world_size(start) == 2


@pytest.mark.slow
def test_zero3_checkpoint_of_2_ranks_resumes_on_1(tmp_path):
    """ZeRO-3, where DeepSpeed's universal loader needs two repairs (each param group's own
    hyper-parameters, a ``step`` tensor per AdamW state; see ``_repair_zero3_universal_load``)."""
    straight_out = tmp_path / "straight"
    record = _run(2, straight_out, strategy="deepspeed_stage_3")
    ckpts = straight_out / "run" / "checkpoints"
    straight = {"losses": mean_losses(record, 2), "logits": _probe_logits(ckpts / "last.ckpt")}
    start = ckpts / f"step{RESUME_AT:06d}.ckpt"
    _run(1, tmp_path / "resumed", f"train.resume={start}", strategy="deepspeed_stage_3")
    _check_continues(straight, tmp_path / "resumed", 1)
