"""Packaging: our top-level ``kernels/`` folder never shadows the PyPI package ``kernels``, and
``unicache_train.kernels`` is our Triton files in an editable and in a wheel install.

transformers >= 5.25 depends on and imports the PyPI package ``kernels``; while our folder had an
``__init__.py`` it was a regular package at the repository root and won the path scan whenever the
root came first on ``sys.path`` (``python -m`` from the root, pytest's ``pythonpath``), so
``import transformers`` failed (kernels/README.md says how the layout prevents that).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KERNEL_FILES = ("sinkhorn.py", "mhc.py", "decode_attention.py")


def _run_python(code: str, cwd: Path, env_extra: dict[str, str] | None = None) -> dict:
    """Runs ``code`` in a fresh interpreter (this venv) from ``cwd``; returns its JSON output."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(env_extra or {})
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, f"subprocess failed:\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def _kernels_distribution_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_kernels_folder_is_not_a_regular_package():
    # The construction itself: a regular package at the root would win the path scan.
    assert (REPO / "kernels").is_dir()
    assert not (REPO / "kernels" / "__init__.py").exists(), (
        "kernels/__init__.py makes the folder a regular top-level package that shadows the PyPI "
        "package `kernels` (see kernels/README.md)"
    )


def test_site_kernels_wins_with_repo_root_first_on_sys_path():
    code = f"""
import importlib.util, json, sys
sys.path.insert(0, {str(REPO)!r})
import transformers  # imports the PyPI `kernels` when it is installed (transformers >= 5.25)
from transformers.utils import import_utils
spec = importlib.util.find_spec("kernels")
origin = None if spec is None else spec.origin
if spec is not None and spec.origin not in (None, "namespace"):
    import kernels
    origin = kernels.__file__
available = getattr(import_utils, "is_kernels_available", lambda: None)()
print(json.dumps({{"origin": origin, "available": available, "tf": transformers.__version__}}))
"""
    got = _run_python(code, cwd=REPO)
    if _kernels_distribution_installed():
        assert got["origin"] is not None and "site-packages" in got["origin"], got
        assert not Path(got["origin"]).resolve().is_relative_to(REPO / "kernels"), got
    else:
        # Only our folder is there: at most a namespace portion with no module file, which
        # transformers must not take for the package.
        assert got["origin"] in (None, "namespace"), got
        assert got["available"] in (False, None), got


@pytest.mark.parametrize("cwd", ["repo", "elsewhere"])
def test_unicache_kernels_resolves_to_our_files_in_this_install(cwd, tmp_path):
    code = """
import json, importlib
mods = {n: importlib.import_module("unicache_train.kernels." + n).__file__
        for n in ("sinkhorn", "mhc", "decode_attention")}
print(json.dumps(mods))
"""
    got = _run_python(code, cwd=REPO if cwd == "repo" else tmp_path)
    for name, path in got.items():
        assert Path(path).resolve() == (REPO / "kernels" / f"{name}.py").resolve(), (name, path)


def test_unicache_kernels_resolves_to_our_files_in_a_wheel_install(tmp_path):
    # Build from a copy of the sources the wheel needs (symlinks kept as links), so the test
    # leaves no build/ folder behind and checks the package-dir mapping, not the symlink.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("unicache_train", "kernels"):
        shutil.copytree(
            REPO / name,
            src / name,
            symlinks=True,
            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
        )
    (src / "unicache_train" / "kernels").unlink()  # the wheel must not need the source symlink
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(wheels), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    (wheel,) = wheels.glob("unicache_train-*.whl")
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target)]
        + [str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-4000:]
    assert not (target / "kernels").exists(), "the wheel installed a top-level `kernels`"
    code = """
import json, importlib
import unicache_train
mods = {n: importlib.import_module("unicache_train.kernels." + n).__file__
        for n in ("sinkhorn", "mhc", "decode_attention")}
print(json.dumps({"pkg": unicache_train.__file__, **mods}))
"""
    # The wheel's copy comes first on sys.path, ahead of this venv's editable install.
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    got = _run_python(code, cwd=elsewhere, env_extra={"PYTHONPATH": str(target)})
    assert Path(got.pop("pkg")).is_relative_to(target), got
    for name, path in got.items():
        installed = target / "unicache_train" / "kernels" / f"{name}.py"
        assert Path(path) == installed, (name, path)
        assert installed.read_bytes() == (REPO / "kernels" / f"{name}.py").read_bytes()
    assert set(got) == {f.removesuffix(".py") for f in KERNEL_FILES}


def test_pin_versions_writes_constraints_and_records_the_suite(tmp_path):
    from scripts.pin_versions import KEY_PACKAGES, record, suite_outcome, write_constraints

    out = tmp_path / "constraints.txt"
    write_constraints({"torch": "2.13.0+cpu", "transformers": "5.25.0"}, out, source="venv")
    pins = [line for line in out.read_text().splitlines() if not line.startswith("#")]
    assert pins == ["torch==2.13.0", "transformers==5.25.0"]  # local label dropped, sorted

    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite tests="10" failures="1" errors="1" skipped="3"/></testsuites>'
    )
    assert suite_outcome(junit) == {
        "tests": 10,
        "failures": 1,
        "errors": 1,
        "skipped": 3,
        "passed": 5,
    }
    csv_path = tmp_path / "latest.csv"
    rows = record(sys.executable, junit, csv_path)
    assert [r["package"] for r in rows] == list(KEY_PACKAGES)
    assert {r["suite"] for r in rows} == {"fail"}  # a failure or an error fails the suite
    torch_row = next(r for r in rows if r["package"] == "torch")
    assert torch_row["version"].startswith(importlib.metadata.version("torch").split("+")[0])
    assert csv_path.read_text().count("\n") == len(KEY_PACKAGES) + 1  # header once
