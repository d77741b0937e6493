"""The recipes behind README tables write their results as CSV led by the command that wrote them
(``# <command>`` then ``# <machine>, torch <version>, <seconds>s``), so a committed copy under
``experiments/*/results/`` names how to reproduce it."""

from __future__ import annotations

import csv
import importlib
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _recipe(name: str):
    return importlib.import_module(f"recipes.{name}")


def _read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    lines = path.read_text().splitlines()
    comments = [ln for ln in lines if ln.startswith("#")]
    rows = list(csv.DictReader(ln for ln in lines if not ln.startswith("#")))
    return comments, rows


@pytest.mark.parametrize("omp", [None, "1"])
def test_command_line_names_the_recipe_and_its_arguments(monkeypatch, omp) -> None:
    from unicache_train.recipe import command_line

    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    cmd = command_line("finetune_xkv", ["--checkpoint", "a b.ckpt", "train.max_steps=5"])
    prefix = "" if omp is None else f"OMP_NUM_THREADS={omp} "
    args = "--checkpoint 'a b.ckpt' train.max_steps=5"
    assert cmd == f"{prefix}python recipes/finetune_xkv.py {args}"


def test_finetune_compress_csv_leads_with_the_command(tmp_path) -> None:
    from unicache_train.recipe import write_results_csv

    rows = [
        {"model": "uncompressed (base)", "ppl": 1.5},
        {"model": "base + compressed", "ppl": 1.6},
    ]
    out = tmp_path / "sub" / "t.csv"
    write_results_csv(out, rows, "python recipes/finetune_compress.py x.y=1", 503.4)
    comments, back = _read(out)
    assert comments[0] == "# python recipes/finetune_compress.py x.y=1"
    assert comments[1].endswith(", 503s") and "torch" in comments[1]
    assert [r["model"] for r in back] == ["uncompressed (base)", "base + compressed"]
    assert [float(r["ppl"]) for r in back] == [1.5, 1.6]
    assert all(r["wall_s_total"] == "503" for r in back)


def test_convert_to_mla_csv_has_one_row_per_model() -> None:
    recipe = _recipe("convert_to_mla")
    result = {
        "kv_elements_per_token_per_layer": {"gqa": 128, "mla": 32, "reduction": 4.0},
        "ppl": {
            "source": 2.0,
            "mla svd": 3.0,
            "mla random": 5.0,
            "mla random + heal": 4.0,
            "mla svd + heal": 2.2,
            "source + heal": 1.8,
        },
        "wall_seconds": 12.0,
    }
    rows = recipe.csv_rows(result)
    by = {r["model"]: r for r in rows}
    assert list(by) == list(result["ppl"])
    assert by["source"]["kv_elements_per_token_per_layer"] == 128
    assert by["mla svd + heal"]["kv_elements_per_token_per_layer"] == 32
    assert by["mla svd + heal"]["vs_source"] == pytest.approx(0.1)
    assert by["mla svd + heal"]["vs_fair_reference"] == pytest.approx(2.2 / 1.8 - 1)
    assert by["mla svd"]["vs_fair_reference"] == pytest.approx(3.0 / 1.8 - 1)
    # Without the control run there is no fair reference.
    del result["ppl"]["source + heal"]
    assert all(r["vs_fair_reference"] != r["vs_fair_reference"] for r in recipe.csv_rows(result))


def test_convert_to_mla_writes_its_csv(tmp_path) -> None:
    recipe = _recipe("convert_to_mla")
    cfg = recipe.RecipeConfig.load(
        RECIPES / "convert_to_mla.yaml",
        [
            "run.train.max_steps=1",
            "run.data.seq_len=32",
            "run.data.batch_size=2",
            "run.data.synthetic.num_stories=20",
            "run.data.synthetic.num_recall=0",
            "convert.heal_steps=1",
            "convert.calib_batches=1",
            "convert.eval_batches=1",
            "convert.export=false",
            f"convert.out_dir={tmp_path}",
        ],
    )
    result = recipe.main(cfg, command="python recipes/convert_to_mla.py convert.heal_steps=1")
    comments, back = _read(tmp_path / "convert_to_mla.csv")
    assert comments[0] == "# python recipes/convert_to_mla.py convert.heal_steps=1"
    assert [r["model"] for r in back] == list(result["ppl"])
    assert float(back[0]["ppl"]) == pytest.approx(result["ppl"]["source"], rel=1e-5)
