"""Read what an offline W&B run logged, without network (``wandb leet inspect``)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

_RECORD = re.compile(r"^# record \d+: (\w+)")
_KEY = re.compile(r'^\s*nested_key:\s+"(.*)"')
_VALUE = re.compile(r'^\s*value_json:\s+"(.*)"')


def _wandb_exe() -> str:
    exe = Path(sys.executable).with_name("wandb")
    return str(exe) if exe.exists() else (shutil.which("wandb") or "wandb")


def read_offline_history(run_dir: str | Path) -> list[dict[str, object]]:
    """History rows of an offline run directory (``.../wandb/offline-run-*``).

    wandb >= 0.31 writes offline runs only as ``run-*.wandb`` protobuf records; ``wandb leet
    inspect`` prints them as text, which is parsed here.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no W&B run directory at {run_dir}")
    proc = subprocess.run([_wandb_exe(), "leet", "inspect", str(run_dir)], capture_output=True,
                          text=True, check=True, timeout=120)
    rows: list[dict[str, object]] = []
    kind, key = None, None
    for line in proc.stdout.splitlines():
        m = _RECORD.match(line)
        if m:
            kind = m.group(1)
            if kind == "history":
                rows.append({})
            continue
        if kind != "history":
            continue
        if (m := _KEY.match(line)) is not None:
            key = m.group(1)
        elif (m := _VALUE.match(line)) is not None and key is not None:
            raw = m.group(1).encode().decode("unicode_escape")
            try:
                rows[-1][key] = json.loads(raw)
            except json.JSONDecodeError:
                rows[-1][key] = raw
            key = None
    return rows
