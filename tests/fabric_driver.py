"""Training driver for the multi-process tests (not a test module).

    fabric run --accelerator cpu --devices 2 --strategy deepspeed_stage_2 \\
        tests/fabric_driver.py RECORD.jsonl [--kill-rank R --kill-in-save STEP] OVERRIDES...

Runs :func:`unicache_train.train.run.fit` on the default :class:`RunConfig` plus the overrides,
with a callback that appends one JSON line per rank and training step to ``RECORD.jsonl``:
``{"rank", "step", "loss", "batch", "weights"}`` (``step``: the global step the batch trained;
``batch``: a fingerprint of its ``input_ids``; ``weights``: a fingerprint of the model's
parameters after the step, null under ZeRO-3 where a rank holds only its partition).
``--kill-in-save STEP`` makes rank ``--kill-rank`` write half of its ZeRO optimizer shard of the
step-``STEP`` checkpoint and then SIGKILL itself (a rank dying in the middle of a checkpoint
write). ``--after-fit FILE`` exercises what :func:`~unicache_train.train.run.fit`'s docstring
promises a distributed caller once it returns: each rank appends one JSON line to ``FILE``
(the group still up, an all-reduce and a barrier on it, the final checkpoint visible to every
rank after that barrier), then calls ``fit`` a second time (2 more steps, resumed from the first
run's ``last.ckpt``) and appends a second line.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys

import lightning as L
import torch

from unicache_train.train.config import RunConfig
from unicache_train.train.run import fit
from unicache_train.validation import apply_overrides


def batch_fingerprint(input_ids: torch.Tensor) -> str:
    """input_ids: [B, T] -> a short hash of the token ids."""
    return hashlib.sha1(input_ids.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16]


def weights_fingerprint(model: torch.nn.Module) -> str | None:
    """A short hash of every parameter's bytes; None when ZeRO-3 has partitioned them."""
    h = hashlib.sha1()
    for name, p in model.named_parameters():
        if hasattr(p, "ds_id"):  # a ZeRO-3 parameter: this rank holds a slice only
            return None
        h.update(name.encode())
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class Recorder(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        row = {
            "rank": trainer.global_rank,
            "step": trainer.global_step - 1,  # global_step already counts this batch's update
            "loss": float(outputs["loss"]),
            "batch": batch_fingerprint(batch["input_ids"]),
            "weights": weights_fingerprint(pl_module),
        }
        with open(self.path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def _kill_in_zero_save(rank: int, step: int) -> None:
    """Make ``rank`` die half-way through writing its ZeRO shard of the step-``step`` checkpoint."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._save_zero_checkpoint

    def save(self, save_path, tag):
        if int(os.environ.get("RANK", 0)) == rank and f"step{step:06d}.ckpt" in str(save_path):
            name = self._get_zero_ckpt_name(save_path, tag)
            os.makedirs(os.path.dirname(name), exist_ok=True)
            with open(name, "wb") as fh:  # half a shard: what a kill mid-write leaves
                fh.write(b"\x80\x02half-written")
                fh.flush()
                os.fsync(fh.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, save_path, tag)

    DeepSpeedEngine._save_zero_checkpoint = save


def after_fit(path: str, config: RunConfig, trainer: L.Trainer, call: int) -> None:
    """One JSON line per rank: what a caller may do with the process group after ``fit``."""
    import torch.distributed as dist

    row: dict = {"call": call, "rank": trainer.global_rank, "initialized": dist.is_initialized()}
    if row["initialized"]:
        t = torch.tensor([float(trainer.global_rank + 1)])
        dist.all_reduce(t)  # every rank calls it: 1 + 2 = 3 on two ranks
        row["all_reduce"] = float(t)
        row["world_size"] = dist.get_world_size()
        dist.barrier()
    last = os.path.join(config.train.out_dir, "checkpoints", "last.ckpt")
    row["last_ckpt"] = os.path.exists(last)
    row["global_step"] = trainer.global_step
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def main(argv: list[str]) -> None:
    record, *args = argv
    after = None
    if "--after-fit" in args:
        i = args.index("--after-fit")
        after = args[i + 1]
        del args[i : i + 2]
    kill_rank, kill_step = 1, None
    if "--kill-in-save" in args:
        i = args.index("--kill-in-save")
        kill_step = int(args[i + 1])
        del args[i : i + 2]
    if "--kill-rank" in args:
        i = args.index("--kill-rank")
        kill_rank = int(args[i + 1])
        del args[i : i + 2]
    if kill_step is not None:
        _kill_in_zero_save(kill_rank, kill_step)
    config = RunConfig.from_dict(apply_overrides({}, args))
    trainer = fit(config, callbacks=[Recorder(record)])
    if after is not None:
        after_fit(after, config, trainer, 1)
        again = RunConfig.from_dict(
            apply_overrides(
                {}, [*args, f"train.max_steps={config.train.max_steps + 2}", "train.resume=auto"]
            )
        )
        trainer = fit(again, callbacks=[Recorder(record)])
        after_fit(after, again, trainer, 2)


if __name__ == "__main__":
    main(sys.argv[1:])
