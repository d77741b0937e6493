"""Read what an offline W&B run logged, without network (``wandb leet inspect``)."""

from __future__ import annotations

import codecs
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

_RECORD = re.compile(r"^# record \d+: (\w+)")
_ITEM = re.compile(r"^\s*item:\s*\{")
# A history item names its key as a path: one `nested_key` per level (`gain/plot` then
# `_type` for an image's fields), or a single `key`.
_KEY = re.compile(r'^\s*(?:nested_key|key):\s+"(.*)"\s*$')
_VALUE = re.compile(r'^\s*value_json:\s+"(.*)"\s*$')


def _wandb_exe() -> str:
    exe = Path(sys.executable).with_name("wandb")
    return str(exe) if exe.exists() else (shutil.which("wandb") or "wandb")


def _unquote(text: str) -> str:
    """A protobuf text-format string body (C escapes, octal bytes) as a Python string."""
    raw, _ = codecs.escape_decode(text.encode("utf-8"))
    return raw.decode("utf-8", errors="replace")


def inspect_offline_run(run_dir: str | Path) -> str:
    """``wandb leet inspect`` of an offline run directory: its records as protobuf text."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no W&B run directory at {run_dir}")
    proc = subprocess.run(
        [_wandb_exe(), "leet", "inspect", str(run_dir)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return proc.stdout


def parse_history(text: str) -> list[dict[str, object]]:
    """History rows from the text of :func:`inspect_offline_run`.

    A value logged under a nested key comes back nested: an image logged as ``gain/plot`` is
    ``row["gain/plot"] == {"_type": "image-file", "width": ..., ...}``; a dict logged as
    ``{"a": {"b": 2}}`` is ``row["a"] == {"b": 2}``.
    """
    rows: list[dict[str, object]] = []
    kind: str | None = None
    path: list[str] = []
    for line in text.splitlines():
        m = _RECORD.match(line)
        if m:
            kind = m.group(1)
            if kind == "history":
                rows.append({})
            path = []
            continue
        if kind != "history":
            continue
        if _ITEM.match(line):
            path = []
        elif (m := _KEY.match(line)) is not None:
            path.append(_unquote(m.group(1)))
        elif (m := _VALUE.match(line)) is not None and path:
            raw = _unquote(m.group(1))
            try:
                value: object = json.loads(raw)
            except json.JSONDecodeError:
                value = raw
            node = rows[-1]
            for key in path[:-1]:
                child = node.get(key)
                if not isinstance(child, dict):
                    child = node[key] = {}
                node = child
            node[path[-1]] = value
            path = []
    return rows


def read_offline_history(run_dir: str | Path) -> list[dict[str, object]]:
    """History rows of an offline run directory (``.../wandb/offline-run-*``).

    wandb >= 0.31 writes offline runs only as ``run-*.wandb`` protobuf records; ``wandb leet
    inspect`` prints them as text, parsed by :func:`parse_history` (nested keys stay nested).
    """
    return parse_history(inspect_offline_run(run_dir))


def offline_run_finished(run_dir: str | Path) -> bool:
    """Whether the run's file holds its exit record, i.e. the run was finished and written."""
    return any(
        (m := _RECORD.match(line)) is not None and m.group(1) == "exit"
        for line in inspect_offline_run(run_dir).splitlines()
    )
