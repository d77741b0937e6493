"""What the distributed tests share (``test_deepspeed``, ``test_multinode``, ``test_zero_resume``):
the tiny mHC model, the run overrides, launching ``fabric run`` (one node or several over the
loopback rendezvous) on ``tests/fabric_driver.py`` and reading the per-rank rows it records.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "fabric_driver.py"
FABRIC = Path(sys.executable).with_name("fabric")

# 2 layers, hidden 64, mHC n = 4: small enough for several CPU processes on 2 cores.
MODEL = [
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.residual_mode=mhc",
    "model.hc_mult=4",
]


def run_overrides(
    out_dir: Path, *extra: str, batch_size: int, steps: int, checkpoint_every: int
) -> list[str]:
    """The run config of a distributed test: the tiny model, 64-token sequences of the bundled
    corpus, ``batch_size`` per rank, ``steps`` optimizer steps, a checkpoint every
    ``checkpoint_every``, no validation, no logger."""
    return [
        *MODEL,
        "data.seq_len=64",
        f"data.batch_size={batch_size}",
        "data.synthetic.num_stories=60",
        "data.synthetic.num_recall=60",
        f"train.max_steps={steps}",
        "train.warmup_steps=2",
        f"train.checkpoint_every_n_steps={checkpoint_every}",
        "train.limit_val_batches=0",
        f"train.val_every_n_steps={steps}",
        "train.progress_bar=false",
        "train.log_every_n_steps=1",
        "train.accelerator=cpu",
        "logging.logger=none",
        f"train.out_dir={out_dir}",
        *extra,
    ]


def free_port() -> int:
    """A TCP port free on the loopback interface now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_nodes(
    record: Path,
    args: list[str],
    logs: Path,
    num_nodes: int = 2,
    strategy: str = "deepspeed_stage_2",
    timeout: float = 900,
) -> list[int]:
    """Start ``num_nodes`` ``fabric run`` launchers (node ranks 0..n-1, one process each) at
    once, as on ``num_nodes`` machines, and wait for all. Returns their exit codes.

    If one fails, the others are stopped: they would wait for the missing peer until the
    rendezvous timed out.
    """
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    for rank in range(num_nodes):
        with open(logs / f"node{rank}.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    [
                        str(FABRIC),
                        "run",
                        "--accelerator",
                        "cpu",
                        "--devices",
                        "1",
                        "--num-nodes",
                        str(num_nodes),
                        "--node-rank",
                        str(rank),
                        "--main-address",
                        "127.0.0.1",
                        "--main-port",
                        str(port),
                        "--strategy",
                        strategy,
                        str(DRIVER),
                        str(record),
                        *args,
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=ROOT,
                    start_new_session=True,  # its own process group: stopped as a whole below
                )
            )
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        failed = any(p.returncode not in (None, 0) for p in procs)
        if failed or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            break
        time.sleep(0.5)
    return [p.returncode for p in procs]


def fabric_run(
    devices: int, record: Path, args: list[str], strategy: str = "deepspeed_stage_2"
) -> subprocess.CompletedProcess:
    """One node, ``devices`` processes (rendezvous on a free port: not the default 29400, which
    another run on this machine may hold)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            str(FABRIC),
            "run",
            "--accelerator",
            "cpu",
            "--devices",
            str(devices),
            "--strategy",
            strategy,
            "--main-port",
            str(free_port()),
            str(DRIVER),
            str(record),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
    )


_FAILURE_LINE = re.compile(r"terminate called|what\(\)|Abort|SIG[A-Z]{3,}|Error|error:|Fatal")


def failure_report(proc: subprocess.CompletedProcess) -> str:
    """What a failed ``fabric run`` printed, for an assertion message: every line that names an
    error or a signal (from any rank, wherever it is in the output: a rank that aborts first is
    usually not the one whose traceback ends the log), then the tails of stdout and stderr."""
    lines = (proc.stdout + "\n" + proc.stderr).splitlines()
    flagged = list(dict.fromkeys(line for line in lines if _FAILURE_LINE.search(line)))
    return "\n".join(
        [f"exit code {proc.returncode}; lines naming an error or a signal:", *flagged[:60]]
        + ["--- stdout tail ---", proc.stdout[-2000:], "--- stderr tail ---", proc.stderr[-4000:]]
    )


def read_rows(path: Path) -> dict[int, dict[int, dict]]:
    """step -> rank -> the driver's row."""
    rows: dict[int, dict[int, dict]] = defaultdict(dict)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]][row["rank"]] = row
    return dict(sorted(rows.items()))


def mean_losses(path: Path, world_size: int) -> dict[int, float]:
    """Global loss per step: the mean over ranks (equal target counts with packed data)."""
    out = {}
    for step, ranks in read_rows(path).items():
        assert sorted(ranks) == list(range(world_size)), (step, sorted(ranks))
        out[step] = sum(r["loss"] for r in ranks.values()) / world_size
    return out
