"""Tested versions: write a constraints file from a venv, and record which versions passed.

The README's commands and CI install with ``-c constraints/project.txt`` (the versions this
repository was last tested with), so a release on the registry between two sessions cannot
break a fresh clone. ``make test-latest`` tries the newest resolvable versions in a fresh
venv; this script then records what it got and whether the default suite passed, and writes
that venv's versions as a candidate constraints file. Moving the pins is copying a green
candidate over ``constraints/project.txt`` (``make pins-from-latest``).

    python scripts/pin_versions.py freeze --python .venv-latest/bin/python \
        --out runs/test-latest/constraints.txt
    python scripts/pin_versions.py record --python .venv-latest/bin/python \
        --junit runs/test-latest/junit.xml --out scripts/results/test_latest.csv
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# The packages whose releases have broken (or could break) a fresh clone: one CSV row each.
KEY_PACKAGES = (
    "torch",
    "transformers",
    "kernels",
    "lightning",
    "deepspeed",
    "datasets",
    "triton",
    "wandb",
    "safetensors",
    "gguf",
    "accelerate",
    "tokenizers",
    "huggingface-hub",
    "numpy",
    "hyper-connections",
)
# The project itself and packages whose wheel on this machine's disk carries a local label.
_SKIP = {"unicache-train", "unicache_train"}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_versions(python: str) -> dict[str, str]:
    """``{normalized name: version}`` of every distribution in the venv of ``python``."""
    out = subprocess.run(
        [python, "-m", "pip", "list", "--format=freeze", "--exclude-editable"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    versions = {}
    for line in out.splitlines():
        if "==" not in line:
            continue
        name, version = line.split("==", 1)
        if _normalize(name) in _SKIP:
            continue
        versions[_normalize(name)] = version.strip()
    return versions


def write_constraints(versions: dict[str, str], out: Path, source: str, note: str = "") -> None:
    """Writes ``name==version`` lines (local labels such as ``+cpu`` dropped: a constraint
    ``torch==2.13.0`` admits the CPU wheel on disk and a CUDA build of the same release)."""
    lines = [
        "# Versions this repository was last tested with (make install / demo / test and CI use",
        f"# them as pip constraints). Written by scripts/pin_versions.py freeze from {source}.",
        "# Move them with `make test-latest`, then `make pins-from-latest` (README, set-up).",
    ]
    if note:
        lines.append("# " + note)
    for name in sorted(versions):
        lines.append(f"{name}=={versions[name].split('+', 1)[0]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out)


def suite_outcome(junit: Path) -> dict[str, int]:
    """Test counts from pytest's ``--junitxml`` report."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def record(python: str, junit: Path, out: Path) -> list[dict[str, str]]:
    """Appends one row per key package: its version and the default suite's outcome."""
    versions = installed_versions(python)
    counts = suite_outcome(junit)
    verdict = "pass" if counts["failures"] == 0 and counts["errors"] == 0 else "fail"
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    rows = []
    for name in KEY_PACKAGES:
        rows.append(
            {
                "date": when,
                "package": name,
                "version": versions.get(_normalize(name), "not installed"),
                "suite": verdict,
                "passed": str(counts["passed"]),
                "failed": str(counts["failures"] + counts["errors"]),
                "skipped": str(counts["skipped"]),
                "python": platform.python_version(),
                "machine": f"{platform.machine()} {platform.system()}",
            }
        )
    new = not out.exists()
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            writer.writeheader()
        writer.writerows(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    fz = sub.add_parser("freeze", help="write a constraints file from a venv")
    fz.add_argument("--python", default=sys.executable, help="the venv's python")
    fz.add_argument("--out", type=Path, required=True)
    fz.add_argument("--note", default="", help="a comment line for the header (e.g. the outcome)")
    rc = sub.add_parser("record", help="append the key versions and the suite's outcome to a CSV")
    rc.add_argument("--python", default=sys.executable, help="the venv's python")
    rc.add_argument("--junit", type=Path, required=True, help="pytest --junitxml report")
    rc.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.cmd == "freeze":
        write_constraints(
            installed_versions(args.python), args.out, source=args.python, note=args.note
        )
        print(f"wrote {args.out}")
    else:
        if not args.junit.is_file():
            parser.error(f"--junit {args.junit}: no such file (did the test run start?)")
        rows = record(args.python, args.junit, args.out)
        print(f"suite {rows[0]['suite']}: {rows[0]['passed']} passed, {rows[0]['failed']} failed")
        for row in rows:
            print(f"  {row['package']:<18} {row['version']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
