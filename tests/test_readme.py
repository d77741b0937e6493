"""The README is a front door that matches the code: its Python example runs as written, every
relative link of the README and of docs/ points at something that exists, and it stays a page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_is_a_page_not_a_book() -> None:
    assert len(README.read_text().splitlines()) <= 250


PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_points_at_a_file_that_exists(page: Path) -> None:
    missing = [
        target
        for target in LINK.findall(page.read_text())
        if not target.startswith(("http://", "https://", "mailto:"))
        and not (page.parent / target).exists()
    ]
    assert not missing, f"{page.relative_to(ROOT)} links to missing paths: {missing}"


def test_the_python_example_runs_as_written(tmp_path, monkeypatch) -> None:
    from unicache_train.checkpoint.gguf import CheckpointNotFetched, fetched_dir

    try:
        fetched_dir("smollm2")
    except CheckpointNotFetched as err:
        pytest.skip(str(err))
    (block,) = _python_blocks(README.read_text())
    monkeypatch.chdir(tmp_path)  # the example writes under runs/readme
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    namespace: dict = {}
    exec(compile(block, str(README), "exec"), namespace)  # noqa: S102  (our own README)
    export = tmp_path / "runs" / "readme" / "export"
    assert (export / "compression_config.json").is_file()
    assert (export / "config.json").is_file()
