"""Beyond one machine: ``fabric run --num-nodes 2`` as two "nodes" of one process each.

Both launcher invocations run on this machine and meet over the loopback rendezvous
(``--main-address 127.0.0.1`` and a free ``--main-port``), CPU and gloo, ZeRO stage 2 through
``tests/fabric_driver.py``: exactly the command a user types on two machines, with the address of
node 0 in place of 127.0.0.1. The 2-rank checkpoint it writes is then resumed on one process
(the default-suite check of re-sharding; 1 and 4 ranks, and ZeRO-3, are in
``tests/test_zero_resume.py``), and its universal copy is checked against the shards.

Model as in ``tests/test_deepspeed.py`` (2 layers, hidden 64, mHC n = 4, seq 64), 4 sequences per
rank, 4 steps, a checkpoint every 2.

Tolerances (fp32 everywhere):

* Two nodes vs one process with the same 8 sequences per step: only the order of floating-point
  sums differs (the gradient all-reduce): 1e-4, as in ``tests/test_deepspeed.py`` (observed
  <= 1e-6; a wrong global batch gives ~3e-2, since the two rank halves differ by that much).
* The ranks hold bit-identical weights after every step (ZeRO-2 all-gathers the updated
  partitions): compared by hash.
* Resume of the 2-rank checkpoint on 1 process (8 sequences per step, the same global batch):
  the universal checkpoint restores fp32 weights, AdamW moments and step as copies, the data
  position carries over, so the continued curve differs from the uninterrupted 2-rank one only by
  the all-reduce's summation order: 1e-4 (observed <= 1e-6; resuming with the AdamW moments and
  step reset, everything else identical, moves the loss by 2.8e-2 one step later).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed_runs import (  # noqa: E402  (tests/ is on sys.path under pytest)
    fabric_run,
    failure_report,
    launch_nodes,
    mean_losses,
    read_rows,
    run_overrides,
)

from unicache_train.checkpoint.safe_load import UnsafeCheckpointError
from unicache_train.checkpoint.zero import (
    consolidate_zero_checkpoint,
    has_universal_checkpoint,
    is_zero_checkpoint,
    to_universal_checkpoint,
    zero_world_size,
)
from unicache_train.train.config import RunConfig
from unicache_train.validation import apply_overrides

pytest.importorskip("deepspeed")

STEPS = 4
LOSS_ATOL = 1e-4
RESUME_ATOL = 1e-4


def overrides(out_dir: Path, *extra: str, batch_size: int = 4) -> list[str]:
    return run_overrides(out_dir, *extra, batch_size=batch_size, steps=STEPS, checkpoint_every=2)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("two_nodes")
    record = out / "record.jsonl"
    codes = launch_nodes(record, overrides(out / "run"), out)
    logs = {r: (out / f"node{r}.log").read_text() for r in range(2)}
    assert codes == [0, 0], f"exit codes {codes}\n" + "\n".join(
        f"--- node {r} ---\n{text[-4000:]}" for r, text in logs.items()
    )
    return {"out": out / "run", "record": record, "logs": logs}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """One process, 8 sequences per step (in this process): the global batch of the 2 nodes."""
    import fabric_driver

    from unicache_train.train.run import fit

    out = tmp_path_factory.mktemp("reference")
    record = out / "record.jsonl"
    config = RunConfig.from_dict(apply_overrides({}, overrides(out / "run", batch_size=8)))
    fit(config, callbacks=[fabric_driver.Recorder(str(record))])
    return mean_losses(record, world_size=1)


def test_two_nodes_form_one_world_and_train_in_lockstep(two_nodes, reference):
    # Each launcher started one process, and the two met as global ranks 0 and 1 of 2.
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in two_nodes["logs"][0]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in two_nodes["logs"][1]
    rows = read_rows(two_nodes["record"])
    assert sorted(rows) == list(range(STEPS))
    weights = []
    for step, ranks in rows.items():
        assert sorted(ranks) == [0, 1], step
        assert ranks[0]["batch"] != ranks[1]["batch"], step  # each rank its half of the batch
        assert ranks[0]["weights"] == ranks[1]["weights"] is not None, step  # same update
        weights.append(ranks[0]["weights"])
    assert len(set(weights)) == STEPS  # and the weights moved every step
    losses = mean_losses(two_nodes["record"], world_size=2)
    for step in range(STEPS):
        assert abs(losses[step] - reference[step]) <= LOSS_ATOL, (step, losses, reference)
    assert losses[STEPS - 1] < losses[0] - 0.3  # it trained
    last = two_nodes["out"] / "checkpoints" / "last.ckpt"
    assert is_zero_checkpoint(last) and zero_world_size(last) == 2


def test_two_node_checkpoint_resumes_on_one_process(two_nodes, tmp_path):
    """The step-2 checkpoint of the 2 nodes, resumed on 1 process with 8 sequences per step,
    continues the 2-node loss curve (steps 2 and 3)."""
    start = two_nodes["out"] / "checkpoints" / "step000002.ckpt"
    record = tmp_path / "record.jsonl"
    proc = fabric_run(1, record, overrides(tmp_path / "run", f"train.resume={start}", batch_size=8))
    assert proc.returncode == 0, failure_report(proc)
    assert "written by 2 ranks; this run has 1" in proc.stdout + proc.stderr  # re-sharded
    assert has_universal_checkpoint(start) and zero_world_size(start) == 2  # shards untouched
    resumed = mean_losses(record, world_size=1)
    straight = mean_losses(two_nodes["record"], world_size=2)
    assert sorted(resumed) == list(range(2, STEPS))  # no step repeated, none skipped
    for step in resumed:
        assert abs(resumed[step] - straight[step]) <= RESUME_ATOL, (step, resumed, straight)


class _Callable:
    """Stands for anything a pickle could call on load."""


def test_universal_copy_is_exact_reused_and_rebuilt_after_a_kill(two_nodes):
    """The universal copy of the 2 nodes' last checkpoint: its fp32 weights equal DeepSpeed's
    zero_to_fp32 consolidation of the shards (another code path), the AdamW step is the run's;
    a second call keeps it, a conversion killed half-way is redone, a tampered file is refused."""
    ckpt = two_nodes["out"] / "checkpoints" / f"step{STEPS:06d}.ckpt"
    assert to_universal_checkpoint(ckpt) == ckpt and has_universal_checkpoint(ckpt)
    zero = ckpt / "universal" / "zero"
    consolidated = consolidate_zero_checkpoint(ckpt)
    for name, weight in consolidated.items():
        saved = torch.load(zero / name / "fp32.pt", weights_only=True)["param"]
        assert torch.equal(saved, weight), name  # copies, bit for bit
    step = torch.load(zero / "model.norm.weight" / "step.pt", weights_only=True)
    assert int(step) == STEPS
    stamp = (zero / "optimizer_state.pt").stat().st_mtime_ns
    to_universal_checkpoint(ckpt)
    assert (zero / "optimizer_state.pt").stat().st_mtime_ns == stamp  # kept, not redone
    # Killed half-way: the half-written copy is under universal.tmp, latest_universal not written.
    (ckpt / "latest_universal").unlink()
    (ckpt / "universal.tmp").mkdir()
    (ckpt / "universal.tmp" / "half.pt").write_bytes(b"PK\x03\x04")
    assert not has_universal_checkpoint(ckpt)
    to_universal_checkpoint(ckpt)
    assert has_universal_checkpoint(ckpt) and not (ckpt / "universal.tmp").exists()
    assert (zero / "optimizer_state.pt").stat().st_mtime_ns != stamp
    # DeepSpeed unpickles these files in full; one that would call code is refused first.
    torch.save(
        {"param": torch.zeros(1), "hook": _Callable()}, zero / "model.norm.weight" / "exp_avg.pt"
    )
    with pytest.raises(UnsafeCheckpointError, match="exp_avg.pt"):
        to_universal_checkpoint(ckpt)
