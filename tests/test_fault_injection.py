"""Fault injection: hostile and broken inputs, full and read-only disks, diverging runs.

Every case feeds one bad thing to a public entry point (the CLI's ``main``, a recipe's ``main``,
``import_hf``) and asserts the contract of docs/reliability.md:

* one line ``error: <message>`` on stderr naming the file / field and what is allowed, exit code
  2, no traceback;
* nothing was executed (a payload that would create a marker file did not);
* nothing was written half-way (no ``*.tmp``) and nothing was lost (the inputs and every earlier
  checkpoint are byte-identical afterwards).

Most cases call ``main`` in-process; two run the console script to check the real exit code.
Disk-full and read-only cases mount a small tmpfs (root only); elsewhere they skip, saying why.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from unicache_train.checkpoint.integrity import write_manifest
from unicache_train.checkpoint.policy import policy_of, write_compression_config
from unicache_train.cli import main, report_user_errors
from unicache_train.train.config import CompressionTrainConfig

ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "data.seq_len=32",
    "data.batch_size=4",
    "data.synthetic.num_stories=40",
    "data.synthetic.num_recall=40",
    "train.checkpoint_every_n_steps=2",
    "train.val_every_n_steps=100",
    "train.accelerator=cpu",
    "train.progress_bar=false",
    "logging.logger=none",
    "monitor.gain=false",
]


def fit_args(out_dir: Path, steps: int, *extra: str) -> list[str]:
    return ["fit", *TINY, f"train.max_steps={steps}", f"train.out_dir={out_dir}", *extra]


def digest(root: Path) -> dict[str, str]:
    """relative path -> SHA-256 of every file under ``root`` (what "nothing lost" compares)."""
    if root.is_file():
        return {".": hashlib.sha256(root.read_bytes()).hexdigest()}
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def expect_one_line(capsys, fn: Callable[[], object], fragment: str) -> str:
    """``fn`` ends with exit code 2 and one ``error:`` line holding ``fragment``; returns it."""
    with pytest.raises(SystemExit) as exc:
        report_user_errors(fn)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: "), err[-5:]
    assert fragment in err[-1], err[-1]
    assert not any("Traceback" in line for line in err)
    return err[-1]


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished 4-step run: checkpoints at steps 2 and 4, ``last.ckpt``, their manifests."""
    out = tmp_path_factory.mktemp("fi") / "run"
    main(fit_args(out, 4))
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == [
        "last.ckpt",
        "last.ckpt.sha256",
        "step000002.ckpt",
        "step000002.ckpt.sha256",
        "step000004.ckpt",
        "step000004.ckpt.sha256",
    ]
    return out


@pytest.fixture(scope="module")
def export(run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fi_export") / "export"
    main(["export", "--checkpoint", str(run / "checkpoints" / "last.ckpt"), "--out", str(out)])
    return out


@pytest.fixture
def run_copy(run, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


@pytest.fixture
def export_copy(export, tmp_path) -> Path:
    dst = tmp_path / "export"
    shutil.copytree(export, dst)
    return dst


@pytest.fixture
def marker(tmp_path) -> Path:
    """A file that a payload would create: it must never exist."""
    return tmp_path / "PWNED"


def tmpfs(path: Path, *options: str) -> Path:
    """Mount a tmpfs at ``path`` (root only); skip the test, saying why, where it cannot be."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) to make a small or read-only file system")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    return path


@pytest.fixture
def mounts():
    made: list[Path] = []
    yield made
    for p in reversed(made):
        subprocess.run(["umount", "-l", str(p)], capture_output=True)


# ----------------------------------------------------------------------------- YAML
EVIL_YAML = 'train: !!python/object/apply:os.system ["touch {marker}"]\n'


@pytest.mark.parametrize(
    "text, fragment",
    [
        (EVIL_YAML, "is refused: configs are plain data"),
        ("model:\n  hidden_size: [1, 2\n", "invalid YAML"),
        (b"model:\n  name: \xff\xfe\n", "not UTF-8 text"),
    ],
    ids=["python tag", "syntax error", "not utf-8"],
)
def test_bad_fit_yaml_is_one_line_and_runs_nothing(tmp_path, marker, capsys, text, fragment):
    cfg = tmp_path / "bad.yaml"
    if isinstance(text, bytes):
        cfg.write_bytes(text)
    else:
        cfg.write_text(text.format(marker=marker))
    line = expect_one_line(capsys, lambda: main(["fit", "--config", str(cfg)]), fragment)
    assert str(cfg) in line
    assert not marker.exists()


@pytest.mark.parametrize("field", ["train.lr", "compress.unicache.target_rate"])
def test_python_tag_in_a_cli_override_runs_nothing(tmp_path, marker, capsys, field):
    """An override's value is read by our safe loader: the tag is refused (exit 2) and builds
    nothing."""
    value = f'!!python/object/apply:os.system ["touch {marker}"]'
    argv = ["fit", f"{field}={value}", f"train.out_dir={tmp_path}"]
    with pytest.raises(SystemExit) as exc:
        report_user_errors(lambda: main(argv))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err[-2000:]
    assert not marker.exists()


def _recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"fi_{name}", ROOT / "recipes" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_python_tag_in_a_recipe_config_and_override_runs_nothing(tmp_path, marker, capsys):
    from unicache_train.recipe import parse_recipe_args, run_sections

    cfg = tmp_path / "evil.yaml"
    cfg.write_text(EVIL_YAML.format(marker=marker))
    default = ROOT / "recipes" / "pretrain_tiny.yaml"
    expect_one_line(
        capsys,
        lambda: parse_recipe_args(["--config", str(cfg)], default, run_sections(), doc=None),
        f"{cfg}: line 1",
    )
    override = f'train.lr=!!python/object/apply:os.system ["touch {marker}"]'
    expect_one_line(
        capsys,
        lambda: parse_recipe_args([override], default, run_sections(), doc=None),
        "override 'train.lr=",
    )
    assert not marker.exists()


# ----------------------------------------------------------------------------- checkpoints
def _flip(path: Path) -> None:
    b = bytearray(path.read_bytes())
    i = len(b) // 2
    b[i : i + 4] = bytes(x ^ 0xFF for x in b[i : i + 4])
    path.write_bytes(bytes(b))


def _rewrite(path: Path, edit: Callable[[dict], object]) -> None:
    """Edit a checkpoint's dict and save it with a fresh manifest (a well-formed file)."""
    ckpt = torch.load(path, weights_only=True)
    edit(ckpt)  # in place
    torch.save(ckpt, path)
    write_manifest(path)


def _drop(key: str):
    return lambda c: c.pop(key) and None


def _other_shape(c: dict) -> None:
    k = next(k for k in c["state_dict"] if k.endswith("q_proj.weight"))
    c["state_dict"][k] = torch.zeros(3, 3)


def _other_depth(c: dict) -> None:
    c["hyper_parameters"]["config"]["model"]["num_hidden_layers"] = 3


def _huge(c: dict) -> None:
    c["hyper_parameters"]["config"]["model"]["num_hidden_layers"] = 10**9


CKPT_CASES = {
    "bytes changed": (_flip, "its SHA-256 differs from the one in"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:1000]), "1000 bytes, but"),
    "truncated, no manifest": (
        lambda p: (p.write_bytes(p.read_bytes()[:1000]), Path(f"{p}.sha256").unlink()),
        "not a readable checkpoint",
    ),
    "empty, no manifest": (
        lambda p: (p.write_bytes(b""), Path(f"{p}.sha256").unlink()),
        "the file is empty",
    ),
    "garbage, no manifest": (
        lambda p: (p.write_bytes(os.urandom(4096)), Path(f"{p}.sha256").unlink()),
        "not a readable checkpoint",
    ),
    "no hyper-parameters": (
        lambda p: _rewrite(p, _drop("hyper_parameters")),
        "no hyper_parameters.config",
    ),
    "no state dict": (lambda p: _rewrite(p, _drop("state_dict")), "no state_dict mapping"),
    "another model's shape": (lambda p: _rewrite(p, _other_shape), "of another shape"),
    "another layer count": (lambda p: _rewrite(p, _other_depth), "missing (first"),
    "too large for memory": (lambda p: _rewrite(p, _huge), "would not fit in memory"),
}


@pytest.mark.parametrize("case", list(CKPT_CASES))
@pytest.mark.parametrize("command", ["evaluate", "export", "generate"])
def test_bad_checkpoint_is_one_line_everywhere(run_copy, tmp_path, capsys, case, command):
    spoil, fragment = CKPT_CASES[case]
    ckpt = run_copy / "checkpoints" / "last.ckpt"
    spoil(ckpt)
    before = digest(run_copy)
    argv = {
        "evaluate": ["evaluate", "--checkpoint", str(ckpt), "--limit_batches", "1"],
        "export": ["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "out")],
        "generate": ["generate", "--checkpoint", str(ckpt), "--prompt", "hi"],
    }[command]
    t0 = time.perf_counter()
    line = expect_one_line(capsys, lambda: main(argv), fragment)
    assert time.perf_counter() - t0 < 60  # refused, not attempted (1e9 layers must not hang)
    assert "last.ckpt" in line
    assert digest(run_copy) == before
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


# ----------------------------------------------------------------------------- resume
def _resume(run_dir: Path, steps: int, *extra: str) -> list[str]:
    return fit_args(run_dir, steps, "train.resume=auto", *extra)


@pytest.mark.parametrize("spoil", ["bytes changed", "truncated", "deleted"])
def test_resume_falls_back_to_the_newest_intact_checkpoint(run_copy, caplog, spoil):
    ckpts = run_copy / "checkpoints"
    last = ckpts / "last.ckpt"
    if spoil == "deleted":
        last.unlink()
        (ckpts / "last.ckpt.sha256").unlink()
    else:
        CKPT_CASES[spoil][0](last)
    with caplog.at_level("WARNING", logger="unicache_train.train.run"):
        main(_resume(run_copy, 6))
    said = [r.getMessage() for r in caplog.records if "not resuming" in r.getMessage()]
    if spoil != "deleted":
        assert len(said) == 1 and "\n" not in said[0], said
        assert said[0].startswith("not resuming from last.ckpt: ")
        assert said[0].endswith(f"{ckpts / 'step000004.ckpt'} instead")
    else:
        assert not said
    ckpt = torch.load(ckpts / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 6  # continued from 4, not restarted from 0
    assert (ckpts / "step000006.ckpt").is_file() and not (ckpts / "step000002.ckpt.tmp").exists()


def test_a_corrupt_zero_directory_is_skipped_by_resume(run_copy):
    """A ZeRO directory carries its manifest inside; one changed shard byte and resume moves on
    to the newest intact checkpoint, naming the shard."""
    from unicache_train.checkpoint.resume import newest_intact_checkpoint

    ckpts = run_copy / "checkpoints"
    for name in ("last.ckpt", "last.ckpt.sha256"):
        (ckpts / name).unlink()
    zero = ckpts / "last.ckpt"
    (zero / "checkpoint").mkdir(parents=True)
    (zero / "latest").write_text("checkpoint")
    shard = zero / "checkpoint" / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(256)}}, shard)
    write_manifest(zero)
    assert newest_intact_checkpoint(ckpts) == (zero, [])
    _flip(shard)
    found, skipped = newest_intact_checkpoint(ckpts)
    assert found == ckpts / "step000004.ckpt"
    assert skipped[0][0] == zero and "mp_rank_00_model_states.pt" in skipped[0][1]


def test_resume_with_no_intact_checkpoint_refuses_instead_of_restarting(run_copy, capsys):
    ckpts = run_copy / "checkpoints"
    for name in ("last.ckpt", "step000002.ckpt", "step000004.ckpt"):
        _flip(ckpts / name)
    before = digest(run_copy)
    expect_one_line(capsys, lambda: main(_resume(run_copy, 6)), "no intact checkpoint to resume")
    assert digest(run_copy) == before


def test_explicit_resume_of_a_corrupt_file_is_one_line(run_copy, capsys):
    last = run_copy / "checkpoints" / "last.ckpt"
    _flip(last)
    argv = fit_args(run_copy, 6, f"train.resume={last}")
    expect_one_line(capsys, lambda: main(argv), "its SHA-256 differs")


def test_resume_into_another_model_is_one_line(run_copy, capsys):
    argv = _resume(run_copy, 6)
    argv[argv.index("model.intermediate_size=64")] = "model.intermediate_size=48"
    expect_one_line(capsys, lambda: main(argv), "do not fit this run's model")


# ----------------------------------------------------------------------------- non-finite
def test_a_nan_loss_stops_training_before_any_nan_checkpoint(run_copy, capsys):
    """A checkpoint with one NaN weight (written whole, manifest valid): the resumed run stops
    at its first step, names the parameter, and saves nothing."""
    last = run_copy / "checkpoints" / "last.ckpt"

    def poison(c):
        k = next(k for k in c["state_dict"] if k.endswith("layers.1.self_attn.q_proj.weight"))
        c["state_dict"][k][0, 0] = float("nan")

    _rewrite(last, poison)
    before = digest(run_copy / "checkpoints")
    line = expect_one_line(
        capsys, lambda: main(_resume(run_copy, 8)), "training stopped at step 5: the loss is nan"
    )
    assert "first non-finite parameter: model." in line
    assert digest(run_copy / "checkpoints") == before  # no step000006, last.ckpt untouched


def test_export_refuses_non_finite_weights(run_copy, tmp_path, capsys):
    last = run_copy / "checkpoints" / "last.ckpt"
    _rewrite(last, lambda c: c["state_dict"]["model.norm.weight"].fill_(float("inf")))
    argv = ["export", "--checkpoint", str(last), "--out", str(tmp_path / "out")]
    expect_one_line(capsys, lambda: main(argv), "tensor norm.weight has NaN or infinite values")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


# ----------------------------------------------------------------------------- export outputs
def test_export_into_a_non_empty_folder_needs_overwrite(run, export_copy, tmp_path, capsys):
    before = digest(export_copy)
    argv = [
        "export",
        "--checkpoint",
        str(run / "checkpoints" / "last.ckpt"),
        "--out",
        str(export_copy),
    ]
    expect_one_line(capsys, lambda: main(argv), "the folder is not empty; pass --overwrite")
    assert digest(export_copy) == before


def test_export_overwrite_removes_the_previous_exports_files(run, export_copy, capsys):
    """The stale-policy bug: a compression_config.json of an earlier export must not survive."""
    write_compression_config(policy_of(CompressionTrainConfig(enabled=True)), export_copy)
    (export_copy / "leftover_from_old_export.bin").write_bytes(b"x")
    write_manifest(export_copy)  # it was a complete export
    main(
        [
            "export",
            "--checkpoint",
            str(run / "checkpoints" / "last.ckpt"),
            "--out",
            str(export_copy),
            "--overwrite",
            "true",
        ]
    )
    assert not (export_copy / "compression_config.json").exists()
    assert not (export_copy / "leftover_from_old_export.bin").exists()
    assert not leftovers(export_copy.parent)
    from unicache_train.checkpoint.integrity import verify

    assert verify(export_copy)  # the new export's manifest lists exactly what is there


def test_export_overwrite_never_deletes_a_folder_that_is_not_an_export(run, tmp_path, capsys):
    home = tmp_path / "notes"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    argv = [
        "export",
        "--checkpoint",
        str(run / "checkpoints" / "last.ckpt"),
        "--out",
        str(home),
        "--overwrite",
        "true",
    ]
    expect_one_line(capsys, lambda: main(argv), "holds files that are not an export")
    assert (home / "thesis.tex").read_text() == "years of work"


# ----------------------------------------------------------------------------- serving
def _evil_auto_map(export: Path, marker: Path) -> None:
    (export / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    cfg = json.loads((export / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil.EvilModel", "AutoConfig": "evil.EvilConfig"}
    (export / "config.json").write_text(json.dumps(cfg))
    write_manifest(export)


def _ours_tampered(export: Path, marker: Path) -> None:
    from unicache_train.checkpoint.trust import OUR_AUTO_MAP

    root = ROOT / "unicache_train" / "checkpoint" / "remote_code"
    for name in ("configuration_unicache_mhc.py", "modeling_unicache_mhc.py"):
        shutil.copyfile(root / name, export / name)
    with open(export / "modeling_unicache_mhc.py", "a") as fh:
        fh.write(f"\nopen({str(marker)!r}, 'w').write('ran')\n")
    cfg = json.loads((export / "config.json").read_text())
    cfg["auto_map"] = OUR_AUTO_MAP
    (export / "config.json").write_text(json.dumps(cfg))
    write_manifest(export)


def _tokenizer_auto_map(export: Path, marker: Path) -> None:
    tc = export / "tokenizer_config.json"
    doc = json.loads(tc.read_text()) if tc.is_file() else {}
    doc["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    tc.write_text(json.dumps(doc))
    write_manifest(export)  # a consistent directory: the refusal is about the code


def _policy(edit: Callable[[dict], object]):
    def apply(export: Path, marker: Path) -> None:
        write_compression_config(policy_of(CompressionTrainConfig(enabled=True)), export)
        file = export / "compression_config.json"
        doc = json.loads(file.read_text())
        edit(doc)
        file.write_text(json.dumps(doc))

    return apply


def _deep(export: Path, marker: Path) -> None:
    (export / "compression_config.json").write_text("[" * 100_000 + "]" * 100_000)


def _move(name: str, to: str | None):
    def apply(export: Path, marker: Path) -> None:
        for p in export.glob(name):
            if to is None:
                p.unlink()
            else:
                p.rename(export / to)
        (export / "unicache_manifest.json").unlink()

    return apply


SERVE_CASES = {
    "foreign auto_map": (_evil_auto_map, [], "names code that is not unicache_train's own"),
    "our auto_map, tampered code": (_ours_tampered, [], "names code that is not"),
    "tokenizer auto_map": (_tokenizer_auto_map, [], "auto_map names tokenizer code"),
    "weights changed": (lambda e, m: _flip(e / "model.safetensors"), [], "SHA-256 differs"),
    "pickled weights only": (
        _move("model.safetensors", "pytorch_model.bin"),
        [],
        "only pytorch_model.bin (pickled weights are not read",
    ),
    "no weights": (_move("model.safetensors", None), [], "no weights; expected"),
    "no tokenizer": (_move("tokenizer*", None), [], "no tokenizer"),
    "policy: unknown key": (
        _policy(lambda d: d["policy"].update(evil=1)),
        ["--compressed", "true"],
        "unknown key(s) ['evil'] in policy",
    ),
    "policy: top-level auto_map": (
        _policy(lambda d: d.update(auto_map={"x": "evil.X"})),
        ["--compressed", "true"],
        "key(s) ['auto_map'] at the top",
    ),
    "policy: no unicache section": (
        _policy(lambda d: d["policy"].pop("unicache")),
        ["--compressed", "true"],
        "policy.unicache=None",
    ),
    "policy: empty unicache section": (
        _policy(lambda d: d["policy"].update(unicache={})),
        ["--compressed", "true"],
        "policy.unicache={}",
    ),
    "policy: bad setting": (
        _policy(lambda d: d["policy"]["unicache"].update(target_rate=7)),
        ["--compressed", "true"],
        "target_rate=7 is out of range",
    ),
    "policy: nested 100,000 deep": (_deep, ["--compressed", "true"], "nested too deeply"),
    "prompt past the positions": (
        lambda e, m: None,
        ["--max_new_tokens", "5000"],
        "exceed the 4096 positions",
    ),
}


@pytest.mark.parametrize("case", list(SERVE_CASES))
def test_bad_export_is_one_line_and_runs_nothing(export_copy, marker, capsys, case):
    spoil, extra, fragment = SERVE_CASES[case]
    spoil(export_copy, marker)
    argv = [
        "generate",
        "--export",
        str(export_copy),
        "--prompt",
        "hi",
        "--max_new_tokens",
        "2",
        *extra,
    ]
    expect_one_line(capsys, lambda: main(argv), fragment)
    assert not marker.exists()


def test_our_own_mhc_remote_code_serves_without_trust_remote_code(tmp_path, capsys):
    """The allow path: an mHC export's auto_map and code files are ours, byte for byte."""
    from unicache_train.checkpoint.hf import export_hf
    from unicache_train.checkpoint.trust import check_export_dir
    from unicache_train.model import Decoder
    from unicache_train.model.config import ModelConfig

    torch.manual_seed(0)
    model = Decoder(
        ModelConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            residual_mode="mhc",
            hc_mult=2,
        )
    )
    out = export_hf(model, tmp_path / "mhc", tokenizer_from="byte")
    assert check_export_dir(out) is True  # remote code, allowed because it is ours
    main(["generate", "--export", str(out), "--prompt", "hi", "--max_new_tokens", "2"])
    assert "tokens/s" in capsys.readouterr().err


def test_our_own_export_still_serves(export, capsys):
    main(["generate", "--export", str(export), "--prompt", "hi", "--max_new_tokens", "2"])
    assert "tokens/s" in capsys.readouterr().err


# ----------------------------------------------------------------------------- data
@pytest.mark.parametrize(
    "body, fragment",
    [
        (b'{"text": "one"}\n{"text": "t\xffwo"}\n', "line 2: not UTF-8 text"),
        (b'{"text": "one"}\n{"text": "two"\n{"text": "three"}\n', "line 2: invalid JSON"),
    ],
    ids=["not utf-8", "broken json"],
)
def test_bad_jsonl_names_file_and_line(tmp_path, capsys, body, fragment):
    data = tmp_path / "data.jsonl"
    data.write_bytes(body)
    argv = fit_args(tmp_path / "out", 1, f"data.source={data}")
    line = expect_one_line(capsys, lambda: main(argv), fragment)
    assert str(data) in line
    assert not (tmp_path / "out" / "checkpoints").exists() or not any(
        (tmp_path / "out" / "checkpoints").iterdir()
    )


# ----------------------------------------------------------------------------- HF configs, GGUF
HF_CASES = {
    "0 heads": ({"num_attention_heads": 0}, "num_attention_heads=0: expected a whole number"),
    "non-numeric hidden size": ({"hidden_size": "abc"}, "hidden_size='abc': expected a whole"),
    "no heads key": ({"num_attention_heads": None}, "lacks the required field"),
    "positions 1e12": ({"max_position_embeddings": 1e12}, "max_position_embeddings=1000000000000"),
    "layers 1e9": ({"num_hidden_layers": 1e9}, "num_hidden_layers=1000000000"),
    "fractional layers": ({"num_hidden_layers": 2.5}, "num_hidden_layers=2.5"),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_config_nonsense_is_one_line_in_finetune_hf(export_copy, tmp_path, capsys, case):
    change, fragment = HF_CASES[case]
    cfg = json.loads((export_copy / "config.json").read_text())
    for k, v in change.items():
        cfg.pop(k) if v is None else cfg.__setitem__(k, v)
    (export_copy / "config.json").write_text(json.dumps(cfg))
    (export_copy / "unicache_manifest.json").unlink()  # an HF directory from anywhere
    recipe = _recipe("finetune_hf")
    t0 = time.perf_counter()
    line = expect_one_line(
        capsys,
        lambda: recipe.main(
            ["--checkpoint_dir", str(export_copy), f"train.out_dir={tmp_path / 'out'}"]
        ),
        fragment,
    )
    assert time.perf_counter() - t0 < 60  # num_hidden_layers 1e9 used to allocate until killed
    assert str(export_copy) in line


def _gguf_bytes() -> bytes:
    gguf = pytest.importorskip("gguf")
    import tempfile

    import numpy as np

    with tempfile.TemporaryDirectory() as d:
        w = gguf.GGUFWriter(f"{d}/t.gguf", "llama")
        w.add_block_count(2)
        w.add_tensor("token_embd.weight", np.ones((8, 4), dtype=np.float32))
        w.add_tensor("blk.0.attn_q.weight", np.ones((4, 4), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return Path(f"{d}/t.gguf").read_bytes()


GGUF_CASES = {
    "garbage": (lambda b: b"hello, not a model at all" * 8, "not a GGUF file"),
    "unknown version": (lambda b: b[:4] + (9).to_bytes(4, "little") + b[8:], "GGUF version 9"),
    "absurd counts": (
        lambda b: b[:8] + (10**15).to_bytes(8, "little") + b[16:],
        "1000000000000000 tensors",
    ),
    "truncated": (lambda b: b[:-40], "truncated or corrupt"),
    "header only": (lambda b: b[:16], "too short for a GGUF header"),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_bad_gguf_is_one_line(tmp_path, capsys, monkeypatch, case):
    from unicache_train.checkpoint.hf import import_hf

    monkeypatch.setenv("UNICACHE_TRAIN_CACHE", str(tmp_path / "cache"))
    make, fragment = GGUF_CASES[case]
    f = tmp_path / "model.gguf"
    f.write_bytes(make(_gguf_bytes()))
    line = expect_one_line(capsys, lambda: import_hf(f), fragment)
    assert str(f) in line
    assert not (tmp_path / "cache" / "gguf").exists() or not any(
        (tmp_path / "cache" / "gguf").iterdir()
    )


# ----------------------------------------------------------------------------- preflight, disks
def test_a_model_too_large_for_memory_is_refused_before_allocation(tmp_path, capsys):
    argv = fit_args(tmp_path / "out", 1, "model.num_hidden_layers=1000000000")
    t0 = time.perf_counter()
    expect_one_line(capsys, lambda: main(argv), "the model would not fit in memory")
    assert time.perf_counter() - t0 < 60


def test_read_only_out_dir_is_refused_before_the_first_step(tmp_path, capsys, mounts):
    ro = tmpfs(tmp_path / "ro", "ro", "size=1m")
    mounts.append(ro)
    argv = fit_args(ro / "run", 1)
    expect_one_line(capsys, lambda: main(argv), f"train.out_dir {ro / 'run'}: not writable")


def test_evaluate_read_only_out_dir_fails_before_the_sweep(run, tmp_path, capsys, mounts):
    ro = tmpfs(tmp_path / "ro", "ro", "size=1m")
    mounts.append(ro)
    argv = [
        "evaluate",
        "--checkpoint",
        str(run / "checkpoints" / "last.ckpt"),
        "sweep.rates=[0.5]",
        f"sweep.out_dir={ro / 'eval'}",
    ]
    t0 = time.perf_counter()
    expect_one_line(capsys, lambda: main(argv), "sweep.out_dir")
    assert time.perf_counter() - t0 < 30


def test_a_disk_without_room_for_one_checkpoint_is_refused_before_training(
    tmp_path, capsys, mounts
):
    small = tmpfs(tmp_path / "small", "size=64k")
    mounts.append(small)
    expect_one_line(
        capsys, lambda: main(fit_args(small / "run", 1)), "but one checkpoint needs about"
    )


def test_disk_full_during_a_save_leaves_no_tmp_and_the_old_checkpoint(tmp_path, mounts):
    """A real full file system (tmpfs): the write fails with one line naming the path and the
    cause, no ``.tmp`` stays, the previous ``last.ckpt`` and its manifest are intact."""
    from unicache_train.checkpoint.integrity import WriteError, verify
    from unicache_train.train.strategies import AtomicCheckpointIO

    # NOTE: 4 MiB, more than the 1 MiB under which a disk counts as full: the cause must be
    # read at the failure, before the temporary is removed and frees the room again.
    disk = tmpfs(tmp_path / "disk", "size=4m")
    mounts.append(disk)
    io = AtomicCheckpointIO()
    last = disk / "last.ckpt"
    io.save_checkpoint({"w": torch.ones(1000)}, last)
    with pytest.raises(WriteError) as exc:
        io.save_checkpoint({"w": torch.ones(2_000_000)}, last)  # 8 MB on a 4 MiB disk
    msg = str(exc.value)
    assert str(last) in msg and "No space left on device" in msg and "\n" not in msg
    assert not leftovers(disk)
    assert verify(last) and torch.equal(torch.load(last, weights_only=True)["w"], torch.ones(1000))


def test_a_failed_save_anywhere_leaves_no_tmp(tmp_path, monkeypatch):
    """The same without a small file system: the writer fails with ENOSPC part-way."""
    import errno

    from unicache_train.checkpoint.integrity import WriteError
    from unicache_train.train.strategies import AtomicCheckpointIO

    io = AtomicCheckpointIO()
    last = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, last)
    real_save = torch.save

    def full(obj, f, *a, **k):
        real_save(obj, f, *a, **k)  # the bytes land, then the disk fills
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(WriteError, match="No space left on device"):
        io.save_checkpoint({"step": 2}, last)
    monkeypatch.undo()
    assert not leftovers(tmp_path)
    assert torch.load(last, weights_only=True)["step"] == 1


# ----------------------------------------------------------------------------- the console script
@pytest.mark.parametrize("kind", ["evil yaml", "foreign code export"])
def test_console_script_exit_code_2_and_nothing_run(export_copy, tmp_path, marker, kind):
    if kind == "evil yaml":
        cfg = tmp_path / "evil.yaml"
        cfg.write_text(EVIL_YAML.format(marker=marker))
        argv = ["fit", "--config", str(cfg)]
    else:
        _evil_auto_map(export_copy, marker)
        argv = ["generate", "--export", str(export_copy), "--prompt", "hi"]
    proc = subprocess.run(
        [sys.executable, "-m", "unicache_train.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Traceback" not in proc.stderr
    assert not marker.exists()
