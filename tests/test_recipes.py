"""The recipes' one command line (:mod:`unicache_train.recipe`): every recipe loads its default
config, prints its docstring and fields on ``--help``, and imports the library, never another
recipe; ``unicache-train vlm`` reads the VLM recipe's YAML."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from unicache_train.recipe import (
    FinetuneOptions,
    parse_recipe_args,
    pretrain_base,
    recipe_help,
    run_recipe,
    run_sections,
)
from unicache_train.train.config import RunConfig
from unicache_train.validation import ConfigError

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"


def _recipe(name: str):
    return importlib.import_module(f"recipes.{name}")


#: recipe -> how its command line is parsed (the default config, and the arguments it needs).
PARSERS = {
    "finetune_compress": lambda m, argv: m.parse_args(argv),
    "finetune_xkv": lambda m, argv: m.parse_args(argv),
    "vlm_tiny": lambda m, argv: m.parse_args(argv),
    "finetune_hf": lambda m, argv: m.parse(argv or ["--checkpoint_dir", "DIR"]),
    "convert_to_mla": lambda m, argv: m.RecipeConfig.from_args(argv),
}


@pytest.mark.parametrize("name", list(PARSERS))
def test_every_recipe_loads_its_default_config(name: str) -> None:
    assert PARSERS[name](_recipe(name), []) is not None


@pytest.mark.parametrize("name", list(PARSERS))
def test_every_recipe_help_prints_its_docstring_and_fields(name: str, capsys) -> None:
    mod = _recipe(name)
    with pytest.raises(SystemExit) as exit_info:
        PARSERS[name](mod, ["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(mod.__doc__.strip().splitlines()[0])
    assert f"recipes/{name}.yaml" in out and "train.max_steps: int = " in out


@pytest.mark.parametrize("name", ["pretrain_tiny", "pretrain_mhc_tiny"])
def test_one_run_recipes_help(name: str, capsys) -> None:
    with pytest.raises(SystemExit):
        run_recipe(RECIPES / f"{name}.yaml", ["--help"], doc=_recipe(name).__doc__)
    out = capsys.readouterr().out
    assert f"usage: [python | fabric run ...] recipes/{name}.py" in out
    mode = "mhc" if name == "pretrain_mhc_tiny" else "residual"
    assert f"model.residual_mode: str = {mode}" in out


def test_recipes_import_the_library_never_each_other() -> None:
    names = {p.stem for p in RECIPES.glob("*.py")}
    for path in RECIPES.glob("*.py"):
        text = path.read_text()
        assert "spec_from_file_location" not in text and "runpy" not in text, path.name
        for other in names - {path.stem}:
            assert not re.search(rf"^\s*(from|import) {other}\b", text, re.M), (path.name, other)


def test_overrides_flags_and_defaults(tmp_path: Path) -> None:
    yaml = tmp_path / "r.yaml"
    yaml.write_text("recipe:\n  num_recall: 5\ntrain:\n  lr: 1.0e-3\n")
    sections = {"recipe": FinetuneOptions, **run_sections()}
    flags = {"--checkpoint": "recipe.base_checkpoint"}
    defaults = {"recipe": {"num_recall": 1, "limit_batches": 3}}
    data = parse_recipe_args(
        ["--checkpoint=a.ckpt", "train.lr=2e-4"],
        yaml,
        sections,
        doc=None,
        flags=flags,
        defaults=defaults,
    )
    # the YAML over the recipe's defaults, the command line over both
    assert data["recipe"] == {"num_recall": 5, "limit_batches": 3, "base_checkpoint": "a.ckpt"}
    assert data["train"] == {"lr": 2e-4}
    data = parse_recipe_args(["--checkpoint", "b.ckpt"], yaml, sections, doc=None, flags=flags)
    assert data["recipe"]["base_checkpoint"] == "b.ckpt"
    cases = {
        ("--checkpoint",): "--checkpoint needs a value",
        ("--chekpoint", "x"): "unknown flag '--chekpoint'",
        ("trian.lr=1",): "unknown section(s) ['trian']",
        ("train.lr",): "override 'train.lr' must look like section.field=value",
        ("--config",): "--config needs a YAML path",
    }
    for argv, message in cases.items():
        with pytest.raises(ConfigError) as exc:
            parse_recipe_args(list(argv), yaml, sections, doc=None, flags=flags)
        assert message in str(exc.value)
    with pytest.raises(FileNotFoundError, match="config file not found"):
        parse_recipe_args(["--config", str(tmp_path / "no.yaml")], yaml, sections, doc=None)
    text = recipe_help("Doc.", yaml, sections, flags, defaults)
    assert "recipe.num_recall: int = 5" in text and "recipe.limit_batches: int = 3" in text
    assert "train.lr: float = 0.001" in text and "--checkpoint BASE_CHECKPOINT" in text


def test_finetune_recipes_take_pretrain_overrides(monkeypatch, tmp_path: Path) -> None:
    fc = _recipe("finetune_compress")
    argv = [
        f"train.out_dir={tmp_path}",
        "pretrain.train.max_steps=7",
        "pretrain.train.out_dir=elsewhere",
        "logging.logger=csv",
    ]
    options, ft = fc.parse_args(argv)
    assert options.pretrain == {"train": {"max_steps": 7, "out_dir": "elsewhere"}}
    assert Path(options.pretrain_config) == RECIPES / "pretrain_tiny.yaml"
    with pytest.raises(ConfigError, match="recipe.pretrain: write pretrain.SECTION.FIELD=VALUE"):
        fc.parse_args(["recipe.pretrain={}"])
    seen: list[RunConfig] = []
    monkeypatch.setattr("unicache_train.train.run.fit", seen.append)
    last = pretrain_base(options, ft)
    (cfg,) = seen
    # the fine-tune's logger and hardware, resumable; the user's overrides win
    assert cfg.train.max_steps == 7 and cfg.train.out_dir == "elsewhere"
    assert cfg.train.resume == "auto" and cfg.logging.logger == "csv"
    assert last == tmp_path / "pretrain" / "checkpoints" / "last.ckpt"


def test_cli_vlm_reads_the_vlm_recipe_yaml(capsys) -> None:
    from unicache_train.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "vlm",
                "--config",
                str(RECIPES / "vlm_tiny.yaml"),
                "train.max_steps=7",
                "compress.unicache.target_rate=0.5",
                "--print_config",
            ]
        )
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert re.search(r"^  max_steps: 7$", out, re.M) and "target_rate: 0.5" in out
    assert re.search(r"^vision:\n  image_size: 48$", out, re.M)
