"""DeepSpeed ZeRO at scale, exercised on 2 CPU processes (gloo, fp32) through ``fabric run``.

The multi-process runs go through ``tests/fabric_driver.py`` (``fit`` plus a per-rank loss and
batch recorder). Model: 2 layers, hidden 64, mHC with n = 4, seq 64; 4 sequences per rank,
8 steps.

Tolerances (fp32 everywhere):

* ZeRO (2 ranks x 4 sequences) vs one process (8 sequences), same seed: the global batch is
  the same 8 sequences (``SeededSampler`` shards one permutation with stride 2, so the two
  rank batches are exactly the single-process batch), packed blocks have the same number of
  targets, so the mean of the rank losses is the global mean loss, and ZeRO averages the
  gradients. Only the order of floating-point sums differs (gloo all-reduce vs one matmul):
  observed |delta loss| <= 1e-6 over 8 steps. We allow 1e-4: 100x that noise, and still 100x
  below what a wrong global batch gives (the two rank halves differ by ~3e-2 at step 0) and
  far below a wrong learning rate or a missing gradient average (~1e-2 after one step).
* Resume from a ZeRO checkpoint: the fp32 master weights, AdamW state, scheduler and data
  position are restored exactly and the computation is the same, so the continued run
  reproduces the straight one: tolerance 1e-6 (observed: bit-identical).
* Consolidated weights vs the single-process run: 8 AdamW steps of lr <= 3e-3 on weights that
  differ only by summation-order noise: logits agree to 1e-4 (observed ~1e-6).
"""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from unicache_train.checkpoint import load_checkpoint
from unicache_train.checkpoint.zero import (
    consolidate_zero_checkpoint,
    is_zero_checkpoint,
    zero_world_size,
)
from unicache_train.model import Decoder
from unicache_train.train.config import RunConfig
from unicache_train.train.strategies import (
    AtomicDeepSpeedStrategy,
    CPUDeepSpeedStrategy,
    apply_activation_checkpointing,
    build_strategy,
    deepspeed_config,
)
from unicache_train.validation import ConfigError, apply_overrides

pytest.importorskip("deepspeed")

import distributed_runs  # noqa: E402
from distributed_runs import MODEL, run_overrides  # noqa: E402

STEPS = 8
LOSS_ATOL = 1e-4
RESUME_ATOL = 1e-6
LOGITS_ATOL = 1e-4


def overrides(out_dir: Path, *extra: str, batch_size: int = 4) -> list[str]:
    return run_overrides(out_dir, *extra, batch_size=batch_size, steps=STEPS, checkpoint_every=4)


def fabric_run(strategy: str, record: Path, args: list[str]) -> subprocess.CompletedProcess:
    """2 processes on this machine, rendezvous on a free port."""
    return distributed_runs.fabric_run(2, record, args, strategy=strategy)


def read_record(path: Path, world_size: int = 2) -> dict[int, float]:
    """Global loss per step: the mean over ranks (equal target counts with packed data)."""
    per_step: dict[int, list[float]] = defaultdict(list)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        per_step[row["step"]].append(row["loss"])
    assert all(len(v) == world_size for v in per_step.values()), per_step
    return {s: sum(v) / len(v) for s, v in sorted(per_step.items())}


def _check(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, distributed_runs.failure_report(proc)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One process, 8 sequences per step: the trajectory ZeRO must reproduce."""
    import fabric_driver

    from unicache_train.train.run import fit

    out = tmp_path_factory.mktemp("reference")
    record = out / "record.jsonl"
    config = RunConfig.from_dict(apply_overrides({}, overrides(out / "run", batch_size=8)))
    fit(config, callbacks=[fabric_driver.Recorder(str(record))])
    model, _ = load_checkpoint(out / "run" / "checkpoints" / "last.ckpt")
    return {"losses": read_record(record, world_size=1), "model": model}


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("zero2")
    record = out / "record.jsonl"
    _check(fabric_run("deepspeed_stage_2", record, overrides(out / "run")))
    return {"out": out / "run", "losses": read_record(record)}


def probe_logits(model: Decoder) -> torch.Tensor:
    ids = torch.randint(0, 260, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


# ----------------------------------------------------------------------------- selection (fast)
def test_build_strategy_maps_names(tmp_path):
    cfg = RunConfig.from_dict(apply_overrides({}, overrides(tmp_path)))
    for name, stage in [
        ("deepspeed", 2),
        ("deepspeed_stage_2", 2),
        ("deepspeed_stage_3", 3),
        ("deepspeed_stage_1", 1),
    ]:
        cfg.train.strategy = name
        strategy = build_strategy(cfg)
        assert isinstance(strategy, CPUDeepSpeedStrategy)
        assert strategy.config["zero_optimization"]["stage"] == stage
        assert strategy._process_group_backend == "gloo"
        assert strategy.config["train_micro_batch_size_per_gpu"] == cfg.data.batch_size
    for name in ("ddp", "auto", "fsdp"):
        cfg.train.strategy = name
        assert build_strategy(cfg) == name
    cfg.train.strategy, cfg.train.accelerator = "deepspeed_stage_3", "gpu"
    gpu = build_strategy(cfg)
    assert type(gpu) is AtomicDeepSpeedStrategy
    assert gpu.config["zero_optimization"]["overlap_comm"] is True
    with pytest.raises(ConfigError, match="strategy"):
        RunConfig.from_dict(apply_overrides({}, ["train.strategy=deepspeed_stage_4"]))


def test_deepspeed_config_user_json_overrides_defaults(tmp_path):
    user = tmp_path / "ds.json"
    user.write_text(
        json.dumps({"zero_optimization": {"reduce_bucket_size": 1234}, "steps_per_print": 7})
    )
    cfg = RunConfig.from_dict(
        apply_overrides(
            {},
            overrides(
                tmp_path, "train.strategy=deepspeed_stage_3", f"train.deepspeed_config={user}"
            ),
        )
    )
    ds = deepspeed_config(cfg)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 1234  # the user's value
    assert ds["zero_optimization"]["stage"] == 3  # our default survives the merge
    assert ds["steps_per_print"] == 7
    user.write_text(json.dumps({"gradient_accumulation_steps": 4}))
    with pytest.raises(ConfigError, match="accumulate_grad_batches"):
        deepspeed_config(cfg)
    cfg.train.deepspeed_config = str(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="no such file"):
        deepspeed_config(cfg)


def test_bf16_is_autocast_with_fp32_parameters_and_cpu_limits(tmp_path):
    cfg = RunConfig.from_dict(
        apply_overrides(
            {},
            overrides(tmp_path, "train.strategy=deepspeed_stage_2", "train.precision=bf16-mixed"),
        )
    )
    ds = build_strategy(cfg).config
    # DeepSpeed's bf16 mode would cast the mHC parameters to bf16: autocast instead.
    assert ds["bf16"] == {"enabled": False}
    assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    cfg.train.precision = "16-mixed"
    with pytest.raises(ConfigError, match="32-true or bf16-mixed"):
        build_strategy(cfg)
    cfg.train.precision, cfg.train.strategy = "32-true", "deepspeed_stage_2_offload"
    with pytest.raises(ConfigError, match="offload"):
        build_strategy(cfg)
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        RunConfig.from_dict(apply_overrides({}, ["train.activation_checkpointing=1"]))


def test_activation_checkpointing_same_gradients_same_names():
    cfg = RunConfig.from_dict(apply_overrides({}, MODEL)).model
    torch.manual_seed(0)
    plain, recompute = Decoder(cfg), Decoder(cfg)
    recompute.load_state_dict(plain.state_dict())
    assert apply_activation_checkpointing(recompute) == 2
    assert apply_activation_checkpointing(recompute) == 2  # idempotent
    ids = torch.randint(0, 260, (2, 32))
    saved = []
    for model in (plain, recompute):
        nbytes = [0]

        def pack(t, nbytes=nbytes):
            nbytes[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids).logits.float().pow(2).mean()
        loss.backward()
        saved.append(nbytes[0])
    for (name, p), (name2, q) in zip(plain.named_parameters(), recompute.named_parameters()):
        assert name == name2  # no wrapper module: checkpoints and ZeRO shards keep their names
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    assert list(plain.state_dict()) == list(recompute.state_dict())
    assert saved[1] < saved[0] / 2, saved  # the blocks' intermediates are not kept
    with torch.no_grad():  # no recompute machinery without autograd
        torch.testing.assert_close(plain(ids).logits, recompute(ids).logits, rtol=0, atol=0)


# ----------------------------------------------------------------------------- 2 processes
def test_zero2_two_processes_matches_single_process(zero2_run, reference):
    losses, ref = zero2_run["losses"], reference["losses"]
    assert sorted(losses) == list(range(STEPS))
    for step in range(STEPS):
        assert abs(losses[step] - ref[step]) <= LOSS_ATOL, (step, losses[step], ref[step])
    assert losses[STEPS - 1] < losses[0] - 0.5  # it trained
    ckpts = zero2_run["out"] / "checkpoints"
    assert {p.name for p in ckpts.iterdir()} == {"last.ckpt", "step000004.ckpt", "step000008.ckpt"}
    assert is_zero_checkpoint(ckpts / "last.ckpt") and zero_world_size(ckpts / "last.ckpt") == 2
    model, config = load_checkpoint(ckpts / "last.ckpt")
    assert config.train.strategy == "deepspeed_stage_2" and config.model.residual_mode == "mhc"
    torch.testing.assert_close(
        probe_logits(model), probe_logits(reference["model"]), rtol=0, atol=LOGITS_ATOL
    )


def test_zero2_resume_mid_run_continues_exactly(zero2_run, tmp_path):
    """2N steps straight vs N, resume, N more (from the step-N ZeRO checkpoint)."""
    start = zero2_run["out"] / "checkpoints" / "step000004.ckpt"
    record = tmp_path / "record.jsonl"
    _check(
        fabric_run(
            "deepspeed_stage_2", record, overrides(tmp_path / "run", f"train.resume={start}")
        )
    )
    resumed, straight = read_record(record), zero2_run["losses"]
    assert sorted(resumed) == list(range(4, STEPS))  # no step repeated, none skipped
    for step in resumed:
        assert abs(resumed[step] - straight[step]) <= RESUME_ATOL, (step, resumed, straight)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    a, _ = load_checkpoint(ckpt)
    b, _ = load_checkpoint(zero2_run["out"] / "checkpoints" / "last.ckpt")
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=RESUME_ATOL, msg=name)


def test_zero3_with_recompute_matches_single_process_and_consolidates(reference, tmp_path):
    record = tmp_path / "record.jsonl"
    _check(
        fabric_run(
            "deepspeed_stage_3",
            record,
            overrides(tmp_path / "run", "train.activation_checkpointing=true"),
        )
    )
    losses, ref = read_record(record), reference["losses"]
    for step in range(STEPS):
        assert abs(losses[step] - ref[step]) <= LOSS_ATOL, (step, losses[step], ref[step])
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    shards = sorted(p.name for p in (last / "checkpoint").iterdir())
    assert len([s for s in shards if s.endswith("optim_states.pt")]) == 2  # one per rank
    out_file = tmp_path / "consolidated.ckpt"
    state = consolidate_zero_checkpoint(last, out_file, dtype="bf16")
    for name, t in state.items():  # bf16, except the mHC parameters (kept fp32 as in the model)
        assert t.dtype == (
            torch.float32 if "_hc." in name or ".hc_head." in name else torch.bfloat16
        ), name
    assert state["model.lm_head.weight"] is state["model.embed_tokens.weight"]  # still tied
    for path in (last, out_file):  # the directory directly, and the consolidated file
        model, config = load_checkpoint(path)
        assert config.train.activation_checkpointing and config.train.strategy.endswith("3")
        atol = LOGITS_ATOL if path == last else 0.05  # bf16 file: 8-bit mantissa
        torch.testing.assert_close(
            probe_logits(model),
            probe_logits(reference["model"]),
            rtol=0 if path == last else 0.02,
            atol=atol,
        )
    ckpt = torch.load(out_file, weights_only=True)
    assert ckpt["global_step"] == STEPS and ckpt["world_size"] == 2
