"""``unicache-train run --rev``: a run from a clean export of one commit (``revision.py``)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from unicache_train import revision
from unicache_train.cli import main
from unicache_train.validation import ConfigError


def _git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    done = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, check=True
    )
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A throwaway repository: a script that reports what it sees, a package, a symlink."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    (root / "pkg_probe").mkdir()
    (root / "pkg_probe" / "__init__.py").write_text("VERSION = 'v1'\n")
    (root / "data").mkdir()
    (root / "data" / "table.txt").write_text("rows\n")
    os.symlink("../data", root / "pkg_probe" / "data")
    (root / "scripts" / "report.py").write_text(
        "import json, os, sys\n"
        "import pkg_probe\n"
        "out = {'version': pkg_probe.VERSION, 'env': os.environ.get('UNICACHE_TRAIN_REVISION'),\n"
        "       'cwd': os.getcwd(), 'argv': sys.argv[1:], 'file': pkg_probe.__file__}\n"
        "open('report.json', 'w').write(json.dumps(out))\n"
        "sys.exit(int(os.environ.get('PROBE_RC', '0')))\n"
    )
    (root / "pkg_probe" / "__main__.py").write_text(
        "import json, sys, pkg_probe\n"
        "out = {'version': pkg_probe.VERSION, 'argv': sys.argv[1:], 'file': pkg_probe.__file__}\n"
        "open('module.json', 'w').write(json.dumps(out))\n"
    )
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "v1")
    return root


def test_export_is_the_commit_with_links_kept_and_reused(repo: Path, tmp_path: Path) -> None:
    sha = _git(repo, "rev-parse", "HEAD")
    (repo / "pkg_probe" / "__init__.py").write_text("VERSION = 'dirty'\n")  # not committed
    export = revision.export_revision("HEAD", repo, tmp_path / "cache")
    assert export == tmp_path / "cache" / "revs" / sha
    assert (export / "pkg_probe" / "__init__.py").read_text() == "VERSION = 'v1'\n"
    assert (export / "pkg_probe" / "data").is_symlink()
    assert (export / "pkg_probe" / "data" / "table.txt").read_text() == "rows\n"
    assert (export / revision.MARKER).read_text().strip() == sha
    # reused as it is: a file changed inside the export stays changed (nothing re-extracted)
    (export / "data" / "table.txt").write_text("kept\n")
    assert revision.export_revision(sha[:10], repo, tmp_path / "cache") == export
    assert (export / "data" / "table.txt").read_text() == "kept\n"
    # no leftovers of the temporary folder
    assert [p.name for p in (tmp_path / "cache" / "revs").iterdir()] == [sha]


def test_an_incomplete_export_is_replaced(repo: Path, tmp_path: Path) -> None:
    sha = _git(repo, "rev-parse", "HEAD")
    half = tmp_path / "cache" / "revs" / sha
    (half / "pkg_probe").mkdir(parents=True)
    (half / "pkg_probe" / "__init__.py").write_text("VERSION = 'half'\n")  # no marker: killed
    export = revision.export_revision("HEAD", repo, tmp_path / "cache")
    assert (export / "pkg_probe" / "__init__.py").read_text() == "VERSION = 'v1'\n"
    assert (export / revision.MARKER).is_file()


def test_bad_revisions_name_the_value(repo: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--rev='no-such-branch': no such commit"):
        revision.export_revision("no-such-branch", repo, tmp_path / "cache")
    with pytest.raises(ConfigError, match="not a git repository"):
        revision.export_revision("HEAD", tmp_path / "cache2", tmp_path / "cache")
    with pytest.raises(ConfigError, match="give a commit"):
        revision.export_revision("--all", repo, tmp_path / "cache")
    assert not (tmp_path / "cache" / "revs").exists() or not any(
        (tmp_path / "cache" / "revs").iterdir()
    )


def test_run_at_revision_runs_the_commit_in_the_callers_directory(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sha1 = _git(repo, "rev-parse", "HEAD")
    (repo / "pkg_probe" / "__init__.py").write_text("VERSION = 'v2'\n")
    _git(repo, "commit", "-qam", "v2")
    (repo / "pkg_probe" / "__init__.py").write_text("VERSION = 'edit'\n")  # work in progress
    # the caller's directory is the checkout, so its pkg_probe would win without care
    monkeypatch.chdir(repo)
    monkeypatch.setenv("PYTHONPATH", str(repo))
    rc = revision.run_at_revision(sha1, ["scripts/report.py", "--x", "1"], repo, tmp_path / "cache")
    assert rc == 0
    got = json.loads((repo / "report.json").read_text())
    assert got["version"] == "v1" and got["env"] == sha1 and got["argv"] == ["--x", "1"]
    assert Path(got["cwd"]).resolve() == repo.resolve()
    assert (
        Path(got["file"]).resolve().is_relative_to((tmp_path / "cache" / "revs" / sha1).resolve())
    )
    # -m MODULE: `python -m` would put the checkout first on sys.path; the export still wins
    assert revision.run_at_revision("HEAD", ["-m", "pkg_probe", "a"], repo, tmp_path / "cache") == 0
    got = json.loads((repo / "module.json").read_text())
    assert got["version"] == "v2" and got["argv"] == ["a"]
    # a module only the working tree has is not served from it (nor from the checkout's path)
    (repo / "pkg_probe" / "extra.py").write_text("print('from the working tree')\n")
    assert (
        revision.run_at_revision("HEAD", ["-m", "pkg_probe.extra"], repo, tmp_path / "cache") == 1
    )
    # the child's exit code comes back
    monkeypatch.setenv("PROBE_RC", "3")
    assert revision.run_at_revision("HEAD", ["scripts/report.py"], repo, tmp_path / "cache") == 3


def test_a_script_missing_from_the_revision_is_refused(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (repo / "scripts" / "new.py").write_text("print('not committed')\n")
    monkeypatch.chdir(repo)
    with pytest.raises(ConfigError, match=r"SCRIPT='scripts/new.py': no such file in revision"):
        revision.run_at_revision("HEAD", ["scripts/new.py"], repo, tmp_path / "cache")
    with pytest.raises(ConfigError, match="give the script"):
        revision.run_at_revision("HEAD", [], repo, tmp_path / "cache")


def test_cli_run_rev_errors_are_one_line(repo: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(repo)
    for argv, message in [
        (["run"], "--rev REV is required"),
        (["run", "--rev"], "run --rev: give a value"),
        (["run", "--bogus", "x"], "unknown option --bogus"),
        (["run", "--rev", "nope", "scripts/report.py"], "no such commit"),
    ]:
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as stop:
        main(
            [
                "run",
                "--rev",
                "HEAD",
                f"--cache-dir={tmp_path / 'c'}",
                "--repo",
                str(repo),
                "scripts/report.py",
                "--y",
            ]
        )
    assert stop.value.code == 0
    assert json.loads((repo / "report.json").read_text())["argv"] == ["--y"]


def test_current_revision_outside_and_inside_an_export(repo: Path, monkeypatch) -> None:
    monkeypatch.delenv(revision.ENV, raising=False)
    sha = _git(repo, "rev-parse", "HEAD")
    assert revision.current_revision(repo) == {"sha": sha, "dirty": False, "source": "git"}
    (repo / "scratch.txt").write_text("x")
    assert revision.current_revision(repo)["dirty"] is True
    assert revision.current_revision(repo / "data")["source"] == "unknown"  # not the top level
    monkeypatch.setenv(revision.ENV, "abc123")
    assert revision.current_revision(repo) == {"sha": "abc123", "dirty": False, "source": "export"}


@pytest.mark.skipif(
    revision.current_revision(revision.PACKAGE_ROOT)["source"] != "git"
    or os.environ.get(revision.ENV) is not None,
    reason="the package is not a git checkout here",
)
def test_this_library_runs_from_its_own_export(tmp_path: Path, capfd, monkeypatch) -> None:
    """The real package: installed editable, `import unicache_train` in the child is still the
    export's, which records the export's sha (the kernels symlink survives git archive)."""
    monkeypatch.chdir(revision.PACKAGE_ROOT)
    sha = _git(revision.PACKAGE_ROOT, "rev-parse", "HEAD")
    rc = revision.run_at_revision("HEAD", ["-m", "unicache_train.revision"], ".", tmp_path / "c")
    assert rc == 0
    line = capfd.readouterr().out.strip().splitlines()[-1]
    got = json.loads(line)
    export = tmp_path / "c" / "revs" / sha
    assert got["sha"] == sha and got["source"] == "export"
    assert Path(got["package"]).resolve() == export.resolve()
    assert (export / "unicache_train" / "kernels").is_symlink()
    assert any((export / "unicache_train" / "kernels").iterdir())
    # a module the working tree has and the revision lacks is not served by the editable install
    probe = revision.PACKAGE_ROOT / "unicache_train" / "_uncommitted_probe.py"
    probe.write_text("print('served from the checkout')\n")
    try:
        rc = revision.run_at_revision(
            "HEAD", ["-m", "unicache_train._uncommitted_probe"], ".", tmp_path / "c"
        )
    finally:
        probe.unlink()
    assert rc == 1
    assert "served from the checkout" not in capfd.readouterr().out
    # a unicache-train command through the export
    from unicache_train.cli import COMMANDS

    rc = revision.run_at_revision("HEAD", ["fetch", "--help"], ".", tmp_path / "c", COMMANDS)
    assert rc == 0
    assert "fetch" in capfd.readouterr().out
