"""Checkpoints are read as plain data: a pickle that would run code is refused, unrun.

The malicious files below hold an object whose ``__reduce__`` makes the full unpickler call
``open(marker, "w")``. ``test_the_payload_is_live`` proves that the full unpickler
(``weights_only=False``, what these loaders used) does create the marker; every other test asserts
that a loader refuses the file with :class:`UnsafeCheckpointError` naming it, and that the marker
was never created. A normal checkpoint written by a short fit still loads through every path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from unicache_train.checkpoint import load_checkpoint
from unicache_train.checkpoint.safe_load import UnsafeCheckpointError, load_torch_file
from unicache_train.checkpoint.zero import consolidate_zero_checkpoint, read_zero_client_state
from unicache_train.data.config import DataConfig, SyntheticDataConfig
from unicache_train.model.config import ModelConfig
from unicache_train.train.config import LoggingConfig, RunConfig, TrainConfig
from unicache_train.train.strategies import AtomicCheckpointIO

ROOT = Path(__file__).resolve().parents[1]


class _Payload:
    """Pickles as ``open(marker, "w")``: whoever unpickles it with the full unpickler runs it."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _evil_checkpoint(path: Path, marker: Path) -> Path:
    """A file shaped like one of our Lightning checkpoints, with the payload in its config."""
    torch.save(
        {
            "state_dict": {"model.embed_tokens.weight": torch.zeros(2, 2)},
            "hyper_parameters": {"config": {"model": _Payload(marker)}},
            "global_step": 1,
        },
        path,
    )
    return path


def _evil_zero_dir(path: Path, marker: Path, evil: str = "model") -> Path:
    """A ZeRO checkpoint directory whose model-states (``evil="model"``) or optimizer-states
    (``evil="optim"``) file carries the payload."""
    tag = path / "checkpoint"
    tag.mkdir(parents=True)
    (path / "latest").write_text("checkpoint")
    plain = {"global_step": 1, "hyper_parameters": {"config": {}}}
    torch.save(
        {**plain, "payload": _Payload(marker)} if evil == "model" else plain,
        tag / "mp_rank_00_model_states.pt",
    )
    optim = {"optimizer_state_dict": {"zero_stage": 2}}
    torch.save(
        {**optim, "payload": _Payload(marker)} if evil == "optim" else optim,
        tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    )
    return path


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "PWNED"


@pytest.fixture
def evil_ckpt(tmp_path: Path, marker: Path) -> Path:
    return _evil_checkpoint(tmp_path / "evil.ckpt", marker)


def test_the_payload_is_live(tmp_path, marker, evil_ckpt):
    torch.load(evil_ckpt, weights_only=False)
    assert marker.exists()  # the full unpickler ran it: the refusals below are real


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "hi"],
        ["evaluate"],
        ["export", "--out", "OUT"],
    ],
)
def test_cli_refuses_a_malicious_checkpoint(tmp_path, marker, evil_ckpt, capsys, argv):
    from unicache_train.cli import main

    argv = [a.replace("OUT", str(tmp_path / "out")) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        main([argv[0], "--checkpoint", str(evil_ckpt), *argv[1:]])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {evil_ckpt}: refused to load: its pickle calls 'io.open'")
    assert "\n" not in err  # one line, no traceback
    assert not marker.exists()


def test_cli_subprocess_refuses_and_runs_nothing(tmp_path, marker, evil_ckpt):
    import subprocess

    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from unicache_train.cli import main; main()",
            "generate",
            "--checkpoint",
            str(evil_ckpt),
            "--prompt",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "refused to load" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists()


def test_loaders_refuse_a_malicious_file(tmp_path, marker, evil_ckpt):
    from unicache_train.train.run import InitFromCheckpoint
    from unicache_train.train.vlm import load_vlm_checkpoint

    loaders = {
        "load_torch_file": lambda: load_torch_file(evil_ckpt),
        "load_checkpoint": lambda: load_checkpoint(evil_ckpt),
        "load_vlm_checkpoint": lambda: load_vlm_checkpoint(evil_ckpt),
        "InitFromCheckpoint": lambda: InitFromCheckpoint(evil_ckpt).setup(None, None, "fit"),
        "AtomicCheckpointIO (resume)": lambda: AtomicCheckpointIO().load_checkpoint(evil_ckpt),
    }
    for name, load in loaders.items():
        with pytest.raises(UnsafeCheckpointError, match=f"{evil_ckpt}: refused to load"):
            load()
        assert not marker.exists(), name


@pytest.mark.parametrize("evil", ["model", "optim"])
def test_zero_directory_loaders_refuse(tmp_path, marker, evil):
    pytest.importorskip("deepspeed")
    ckpt = _evil_zero_dir(tmp_path / "last.ckpt", marker, evil)
    bad = "mp_rank_00_model_states.pt" if evil == "model" else "optim_states.pt"
    loaders = [lambda: load_checkpoint(ckpt), lambda: consolidate_zero_checkpoint(ckpt)]
    if evil == "model":
        loaders.append(lambda: read_zero_client_state(ckpt))
    for load in loaders:
        with pytest.raises(UnsafeCheckpointError, match=rf"{bad}: refused to load"):
            load()
        assert not marker.exists()


@pytest.mark.parametrize("evil", ["model", "optim"])
def test_deepspeed_resume_refuses_before_deepspeed_unpickles(tmp_path, marker, evil):
    pytest.importorskip("deepspeed")
    from unicache_train.train.strategies import CPUDeepSpeedStrategy

    ckpt = _evil_zero_dir(tmp_path / "last.ckpt", marker, evil)
    strategy = CPUDeepSpeedStrategy(config={"zero_optimization": {"stage": 2}})
    strategy.parallel_devices = [torch.device("cpu")]  # a 1-process run, as the files say
    with pytest.raises(UnsafeCheckpointError, match="refused to load"):
        strategy.load_checkpoint(ckpt)
    assert not marker.exists()
    latest_elsewhere = tmp_path / "redirect.ckpt"  # a tag that points out of the directory
    latest_elsewhere.mkdir()
    (latest_elsewhere / "latest").write_text("../last.ckpt/checkpoint")
    with pytest.raises(UnsafeCheckpointError, match="refused to load"):
        strategy.load_checkpoint(latest_elsewhere)
    assert not marker.exists()


# ----------------------------------------------------------------------------- normal files
def _small_config(out_dir: Path, **train) -> RunConfig:
    tc = dict(
        max_steps=2,
        lr=1e-3,
        warmup_steps=0,
        val_every_n_steps=2,
        limit_val_batches=1,
        checkpoint_every_n_steps=2,
        accelerator="cpu",
        devices=1,
        out_dir=str(out_dir),
        progress_bar=False,
        log_every_n_steps=1,
    )
    tc.update(train)
    return RunConfig(
        model=ModelConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            residual_mode="mhc",
            hc_mult=2,
        ),
        data=DataConfig(
            seq_len=64, batch_size=4, synthetic=SyntheticDataConfig(num_stories=40, num_recall=40)
        ),
        train=TrainConfig(**tc),
        logging=LoggingConfig(logger="csv"),
    )


def test_resume_refuses_a_malicious_checkpoint(tmp_path, marker, evil_ckpt):
    from unicache_train.train.run import fit

    with pytest.raises(UnsafeCheckpointError, match=f"{evil_ckpt}: refused to load"):
        fit(_small_config(tmp_path / "run", resume=str(evil_ckpt)))
    assert not marker.exists()


def test_a_normal_checkpoint_is_plain_data_and_loads_everywhere(tmp_path):
    """A fit with mHC, compression in the loop and the monitors writes a file that every
    loader reads with ``weights_only=True``, and resuming from it continues the run."""
    from unicache_train.train.module import LMModule
    from unicache_train.train.run import InitFromCheckpoint, fit

    config = _small_config(tmp_path / "run")
    config.compress.enabled = True
    fit(config)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    raw = torch.load(last, weights_only=True)  # plain data: the restricted unpickler reads it
    assert raw["global_step"] == 2 and raw["hyper_parameters"]["config"]["compress"]["enabled"]
    model, loaded = load_checkpoint(last)
    assert loaded.model.hc_mult == 2
    assert AtomicCheckpointIO().load_checkpoint(last)["global_step"] == 2
    module = LMModule(loaded)
    InitFromCheckpoint(last).setup(None, module, "fit")
    for name, w in model.state_dict().items():
        assert torch.equal(module.model.state_dict()[name], w), name
    resumed = fit(_small_config(tmp_path / "run", max_steps=4, resume="auto"))
    assert resumed.global_step == 4
    assert torch.load(last, weights_only=True)["global_step"] == 4
