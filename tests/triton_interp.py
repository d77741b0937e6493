"""Shared harness of the Triton-kernel tests: the ``interp`` tests of a module run in a child
pytest under ``TRITON_INTERPRET=1`` (the flag must be set before Triton is imported, so they
cannot run in the parent process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def run_interpreter_tests(test_file: str, markers: str, **env_extra: str) -> None:
    """Run ``test_file``'s tests selected by ``markers`` in a child pytest under the
    interpreter; fail with the child's output unless they ran and passed (only the calling
    test, which skips itself in the child, may be skipped)."""
    if INTERPRETER:
        pytest.skip("already under the interpreter: the interp tests run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1", **env_extra)
    cmd = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "-m", markers]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (
        f"interpreter tests failed:\n{res.stdout[-8000:]}\n{res.stderr[-2000:]}"
    )
    skipped = re.search(r"(\d+) skipped", res.stdout)
    assert re.search(r"\d+ passed", res.stdout) and (not skipped or skipped.group(1) == "1"), (
        res.stdout
    )
