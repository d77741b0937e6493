"""Bad input at every public entry point: a clear error naming the field, the value and the
allowed range. From the command line: one line ``error: ...`` on stderr and exit code 2, never a
traceback. Also the happy paths the fixes touch: every usual number notation is a number, and
``unicache-train generate`` prints text.

Entry points covered: the CLI subcommands (fit, evaluate, generate, export), the recipes'
argument/override parsing, the config dataclasses, the compressor configs and the model forward.
(Checkpoint importers have their own table in ``test_hf_checkpoint.py``.)
"""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unicache_train.cli import main
from unicache_train.compress import IdentityCompressor, UniCacheCompressor, UniCacheConfig
from unicache_train.compress.composer import ComposedCompressor
from unicache_train.compress.config import XKVConfig
from unicache_train.data.config import DataConfig
from unicache_train.eval.sweep import CompressionEvalConfig
from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig
from unicache_train.train.config import (
    CompressionTrainConfig,
    MonitorConfig,
    RunConfig,
    TrainConfig,
)
from unicache_train.validation import ConfigError, apply_overrides, load_yaml

ROOT = Path(__file__).resolve().parents[1]


def tiny_config() -> ModelConfig:
    return ModelConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """A tiny checkpoint (plain data, as ``fit`` writes it) and an empty data file."""
    d = tmp_path_factory.mktemp("bad_input")
    torch.manual_seed(0)
    model = Decoder(tiny_config())
    ckpt = d / "tiny.ckpt"
    torch.save(
        {
            "hyper_parameters": {"config": RunConfig(model=model.config).to_dict()},
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        },
        ckpt,
    )
    empty = d / "empty.jsonl"
    empty.write_text("")
    inf_yaml = d / "inf.yaml"
    inf_yaml.write_text("model:\n  rope_theta: .inf\n")
    return {"ckpt": str(ckpt), "empty": str(empty), "dir": str(d), "inf_yaml": str(inf_yaml)}


# ----------------------------------------------------------------------------- the CLI
# argv (with {ckpt}, {empty}, {dir} filled in) -> a fragment of the one-line error.
CLI_CASES = {
    "fit lr negative": (
        ["fit", "train.lr=-1"],
        "TrainConfig.lr=-1 is out of range; allowed (0, 10]",
    ),
    "fit rope_theta inf (yaml)": (
        ["fit", "--config", "{inf_yaml}"],
        "ModelConfig.rope_theta=inf is out of range; allowed (0, inf)",
    ),
    "fit hc_mult without mhc": (
        ["fit", "model.hc_mult=8"],
        "ModelConfig.hc_mult=8 has no effect with residual_mode='residual'",
    ),
    "fit unicache rate": (
        ["fit", "compress.unicache.target_rate=1.5"],
        "UniCacheConfig.target_rate=1.5 is out of range; allowed [0.0, 0.95]",
    ),
    "fit unknown xkv field": (
        ["fit", "compress.xkv.ratio=4"],
        "unknown field(s) ['ratio'] in compress.xkv; known: [",
    ),
    "fit xkv rank_mode": (
        ["fit", "compress.xkv.rank_mode=ratio"],
        "XKVConfig.rank_mode='ratio' is not allowed; choose one of",
    ),
    "fit unicache rate e-notation": (
        ["fit", "compress.unicache.target_rate=2e0"],
        "UniCacheConfig.target_rate=2.0 is out of range",
    ),
    "fit empty data file": (
        [
            "fit",
            "data.source={empty}",
            "logging.logger=none",
            "train.accelerator=cpu",
            "train.progress_bar=false",
            "train.out_dir={dir}/fit",
        ],
        "DataConfig.source: '{empty}' has no records (the file is empty)",
    ),
    "evaluate rates out of range": (
        ["evaluate", "--checkpoint", "{ckpt}", "sweep.rates=[1.5]"],
        "CompressionEvalConfig.rates: 1.5 is out of range; allowed [0, 0.95]",
    ),
    "evaluate unknown sweep field": (
        ["evaluate", "--checkpoint", "{ckpt}", "sweep.xkv_ratios=[4]"],
        "unknown field(s) ['xkv_ratios'] in sweep",
    ),
    "evaluate no checkpoint": (["evaluate"], "evaluate: --checkpoint is required"),
    "unknown command": (["bogus"], "unknown command 'bogus'; choose one of"),
    "evaluate empty data file": (
        ["evaluate", "--checkpoint", "{ckpt}", "data.source={empty}"],
        "DataConfig.source: '{empty}' has no records (the file is empty)",
    ),
    "evaluate missing checkpoint": (
        ["evaluate", "--checkpoint", "{dir}/missing.ckpt"],
        "missing.ckpt",
    ),
    "evaluate logger": (
        ["evaluate", "--checkpoint", "{ckpt}", "--logger", "mlflow"],
        "evaluate --logger='mlflow' is not allowed; choose one of",
    ),
    "evaluate limit_batches": (
        ["evaluate", "--checkpoint", "{ckpt}", "--limit_batches", "0"],
        "evaluate --limit_batches=0 is out of range; allowed an integer",
    ),
    "generate top_k 0": (
        [
            "generate",
            "--checkpoint",
            "{ckpt}",
            "--prompt",
            "hi",
            "--top_k",
            "0",
            "--temperature",
            "1",
        ],
        "generate --top_k=0 is out of range; allowed an integer in [1, inf)",
    ),
    "generate top_k 0 greedy": (
        ["generate", "--checkpoint", "{ckpt}", "--prompt", "hi", "--top_k", "0"],
        "generate --top_k=0 is out of range",
    ),
    "generate max_new_tokens": (
        ["generate", "--checkpoint", "{ckpt}", "--prompt", "hi", "--max_new_tokens", "-3"],
        "generate --max_new_tokens=-3 is out of range; allowed an integer in [0, inf)",
    ),
    "generate temperature": (
        ["generate", "--checkpoint", "{ckpt}", "--prompt", "hi", "--temperature", "-1"],
        "generate --temperature=-1.0 is out of range; allowed [0, inf) (0 = greedy)",
    ),
    "export format": (
        ["export", "--checkpoint", "{ckpt}", "--out", "{dir}/x", "--format", "onnx"],
        "format='onnx': choose one of ['hf', 'deepseek_v3']",
    ),
    "export family": (
        ["export", "--checkpoint", "{ckpt}", "--out", "{dir}/x", "--family", "gpt2"],
        "family='gpt2': choose one of",
    ),
    "export dtype": (
        ["export", "--checkpoint", "{ckpt}", "--out", "{dir}/x", "--dtype", "fp8"],
        "dtype='fp8': choose one of",
    ),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_bad_input_is_one_line_error_exit_2(case, files, capsys) -> None:
    argv, fragment = CLI_CASES[case]
    argv = [a.format(**files) for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "nothing on stderr"
    # Lightning/datasets may log before the failure; ours is the last line, and one line.
    assert err[-1].startswith("error: "), err
    assert fragment.format(**files) in err[-1], err[-1]
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["fit", "train.lr=abc"], "TrainConfig.lr='abc': expected a number in (0, 10], got str"),
        (["fit", "model.rope_theta=inf"], "ModelConfig.rope_theta='inf': expected a number"),
        (["fit", "--no_such_flag", "1"], "unknown flag '--no_such_flag'; known: ['--config'"),
        (
            ["fit", "train.max_steps"],
            "override 'train.max_steps' must look like section.field=value",
        ),
        (
            ["generate", "--checkpoint", "x", "--prompt", "hi", "--max_new_tokens", "abc"],
            "generate --max_new_tokens='abc': expected int",
        ),
    ],
)
def test_cli_type_errors_are_one_line_errors(argv, fragment, capsys) -> None:
    """Values of the wrong type, unknown options and malformed overrides: one line naming the
    field and the value (exit code 2, no traceback), before anything runs."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and fragment in err[0], err


def test_console_script_bad_input_no_traceback(files) -> None:
    """The real entry point, in its own process: exit code 2, one line, no traceback."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "unicache_train.cli",
            "generate",
            "--checkpoint",
            files["ckpt"],
            "--prompt",
            "hi",
            "--top_k",
            "0",
            "--temperature",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=files["dir"],
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: generate --top_k=0 is out of range; allowed an integer in [1, inf) "
        "(unset: sample from the whole vocabulary)"
    ]
    assert "Traceback" not in proc.stderr


def test_generate_prints_text(files) -> None:
    """``unicache-train generate`` on a tiny checkpoint prints the prompt and its continuation
    (the real entry point, in its own process)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "unicache_train.cli",
            "generate",
            "--checkpoint",
            files["ckpt"],
            "--prompt",
            "The cat",
            "--max_new_tokens",
            "6",
            "--temperature",
            "0.8",
            "--top_k",
            "5",
            "--seed",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=files["dir"],
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.rstrip("\n")
    assert out.startswith("The cat") and len(out) > len("The cat"), out
    # The same call in-process returns the continuation it printed (sampling is seeded).
    from unicache_train.cli import generate

    text = generate(files["ckpt"], "The cat", max_new_tokens=6, temperature=0.8, top_k=5, seed=3)
    assert out == "The cat" + text


# ----------------------------------------------------------------------------- numbers
@pytest.mark.parametrize(
    "raw, value",
    [
        ("1e-4", 1e-4),
        ("1E-4", 1e-4),
        ("1e4", 1e4),
        ("+1e3", 1e3),
        (".5", 0.5),
        ("-.5", -0.5),
        ("1_000", 1000),
        ("1.0e-4", 1e-4),
        ("3", 3),
        ("0.3", 0.3),
    ],
)
def test_every_usual_number_notation_is_a_number(raw: str, value: float) -> None:
    got = load_yaml(raw)
    assert not isinstance(got, str) and got == value
    assert apply_overrides({}, [f"train.lr={raw}"])["train"]["lr"] == value


def test_e_notation_in_overrides_yaml_and_cli_flags(tmp_path: Path) -> None:
    cfg = RunConfig.load(RunConfig().save(tmp_path / "c.yaml"), overrides=["train.lr=1e-4"])
    assert cfg.train.lr == 1e-4
    (tmp_path / "d.yaml").write_text("train:\n  lr: 2E-4\ncompress:\n  kl_weight: 5e-1\n")
    cfg = RunConfig.load(tmp_path / "d.yaml")
    assert (cfg.train.lr, cfg.compress.kl_weight) == (2e-4, 0.5)
    from unicache_train.cli import _parse

    kwargs, _ = _parse("fit", ["compress.unicache.target_rate=5e-1"])
    assert kwargs["compress"].unicache.target_rate == 0.5


# ----------------------------------------------------------------------------- recipes
def recipe(name: str):
    return importlib.import_module(f"recipes.{name}")


RECIPE_CASES = {
    "finetune_compress lr": (
        "finetune_compress",
        "parse_args",
        ["train.lr=-1"],
        "TrainConfig.lr=-1 is out of range; allowed (0, 10]",
    ),
    "finetune_compress lr string": (
        "finetune_compress",
        "parse_args",
        ["train.lr=abc"],
        "TrainConfig.lr='abc': expected a number in (0, 10], got str",
    ),
    "finetune_compress recipe option": (
        "finetune_compress",
        "parse_args",
        ["recipe.num_recall=-5"],
        "FinetuneOptions.num_recall=-5 is out of range; allowed [0, inf)",
    ),
    "finetune_compress unknown option": (
        "finetune_compress",
        "parse_args",
        ["recipe.nope=1"],
        "unknown field(s) ['nope'] in recipe",
    ),
    "finetune_compress unknown section": (
        "finetune_compress",
        "parse_args",
        ["recipes.x=1"],
        "unknown section(s) ['recipes']",
    ),
    "finetune_compress unknown flag": (
        "finetune_compress",
        "parse_args",
        ["--checkpont", "x"],
        "unknown flag '--checkpont'",
    ),
    "finetune_compress no value": (
        "finetune_compress",
        "parse_args",
        ["train.lr"],
        "override 'train.lr' must look like section.field=value",
    ),
    "finetune_compress --config": (
        "finetune_compress",
        "parse_args",
        ["--config"],
        "--config needs a YAML path",
    ),
    "finetune_compress rate": (
        "finetune_compress",
        "parse_args",
        ["compress.unicache.target_rate=1.5"],
        "UniCacheConfig.target_rate=1.5 is out of range",
    ),
    "finetune_hf no checkpoint": (
        "finetune_hf",
        "parse",
        [],
        "hf.checkpoint_dir is not set: pass --checkpoint_dir DIR",
    ),
    "finetune_hf unknown": (
        "finetune_hf",
        "parse",
        ["hf.checkpoint_dir=x", "hf.nope=1"],
        "unknown field(s) ['nope'] in hf",
    ),
    "finetune_xkv reductions": (
        "finetune_xkv",
        "parse_args",
        ["recipe.eval_reductions=[0.5]"],
        "recipe.eval_reductions=[0.5]: expected a list of reductions in [1, 64]",
    ),
    "finetune_xkv unknown recipe field": (
        "finetune_xkv",
        "parse_args",
        ["recipe.train_ratios=[4]"],
        "unknown field(s) ['train_ratios'] in recipe",
    ),
    "finetune_xkv unknown xkv field": (
        "finetune_xkv",
        "parse_args",
        ["compress.xkv.ratio=8"],
        "unknown field(s) ['ratio'] in compress.xkv",
    ),
    "finetune_xkv bool": (
        "finetune_xkv",
        "parse_args",
        ["recipe.control=maybe"],
        "recipe.control='maybe': expected a bool",
    ),
    "vlm_tiny unknown": (
        "vlm_tiny",
        "parse_args",
        ["recipe.nope=1"],
        "unknown field(s) ['nope'] in recipe",
    ),
    "vlm_tiny rates": (
        "vlm_tiny",
        "parse_args",
        ["recipe.rates=[1.5]"],
        "RecipeOptions.rates=[1.5]: expected a list of rates in [0, 0.95]",
    ),
    "vlm_tiny steps": (
        "vlm_tiny",
        "parse_args",
        ["recipe.vision_steps=-1"],
        "RecipeOptions.vision_steps=-1 is out of range; allowed [0, inf)",
    ),
    "convert_to_mla unknown": (
        "convert_to_mla",
        "cli",
        ["convert.nope=1"],
        "unknown field(s) ['nope'] in convert",
    ),
    "convert_to_mla lr": (
        "convert_to_mla",
        "cli",
        ["convert.heal_lr=-1e-3"],
        "ConvertConfig.heal_lr=-0.001 is out of range; allowed (0, 10]",
    ),
}


@pytest.mark.parametrize("case", list(RECIPE_CASES))
def test_recipe_argument_errors(case: str) -> None:
    name, fn, argv, fragment = RECIPE_CASES[case]
    with pytest.raises(ConfigError) as exc:
        getattr(recipe(name), fn)(argv)
    assert fragment in str(exc.value)


def test_recipe_overrides_read_e_notation() -> None:
    opts, cfg = recipe("finetune_compress").parse_args(["train.lr=1e-4", "recipe.num_recall=3"])
    assert cfg.train.lr == 1e-4 and opts.num_recall == 3
    _, base = recipe("vlm_tiny").parse_args(["train.lr=5E-4"])
    assert base.train.lr == 5e-4


def test_recipe_main_reports_bad_input_in_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "pretrain_tiny.py"), "model.hc_mult=8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("error: ModelConfig.hc_mult=8 has no effect with residual_mode='residual'")
    )


# ----------------------------------------------------------------------------- python API
def raises(exc: type[BaseException], fn, fragment: str):
    return exc, fn, fragment


def _model() -> Decoder:
    torch.manual_seed(0)
    return Decoder(tiny_config()).eval()


def _forward(split, T: int = 8):
    return lambda: _model()(
        torch.zeros(2, T, dtype=torch.long), split=split, compressor=IdentityCompressor()
    )


API_CASES = {
    # config dataclasses
    "ModelConfig rope_theta inf": raises(
        ConfigError,
        lambda: ModelConfig(rope_theta=math.inf),
        "ModelConfig.rope_theta=inf is out of range; allowed (0, inf)",
    ),
    "ModelConfig rope_theta nan": raises(
        ConfigError,
        lambda: ModelConfig(rope_theta=math.nan),
        "ModelConfig.rope_theta=nan is out of range; allowed (0, inf)",
    ),
    "ModelConfig hc_mult without mhc": raises(
        ConfigError,
        lambda: ModelConfig(hc_mult=8),
        "ModelConfig.hc_mult=8 has no effect with residual_mode='residual' (a plain residual "
        "has one stream); set residual_mode to 'mhc' or 'hc' for 8 streams, or hc_mult to 1",
    ),
    "ModelConfig vocab float": raises(
        ConfigError,
        lambda: ModelConfig(vocab_size=2.5),
        "ModelConfig.vocab_size=2.5: expected an integer in [2, inf)",
    ),
    "TrainConfig lr string": raises(
        ConfigError,
        lambda: TrainConfig(lr="1e-4"),
        "TrainConfig.lr='1e-4': expected a number in (0, 10], got str",
    ),
    "TrainConfig grad_clip inf": raises(
        ConfigError,
        lambda: TrainConfig(grad_clip=math.inf),
        "TrainConfig.grad_clip=inf is out of range; allowed [0, inf)",
    ),
    "DataConfig seq_len": raises(
        ConfigError,
        lambda: DataConfig(seq_len=1),
        "DataConfig.seq_len=1 is out of range; allowed [2, 1048576]",
    ),
    "MonitorConfig threshold": raises(
        ConfigError,
        lambda: MonitorConfig(gain_threshold=1.0),
        "MonitorConfig.gain_threshold=1.0 is out of range; allowed (1, inf)",
    ),
    "CompressionTrainConfig kl": raises(
        ConfigError,
        lambda: CompressionTrainConfig(kl_weight=-1.0),
        "CompressionTrainConfig.kl_weight=-1.0 is out of range; allowed [0, 1000]",
    ),
    "CompressionEvalConfig rates": raises(
        ConfigError,
        lambda: CompressionEvalConfig(rates=[1.5]),
        "CompressionEvalConfig.rates: 1.5 is out of range; allowed [0, 0.95]",
    ),
    "RunConfig unknown field": raises(
        ConfigError,
        lambda: RunConfig.from_dict({"model": {"hiden_size": 3}}),
        "unknown field(s) ['hiden_size'] in model",
    ),
    # compressor configs
    "ComposedCompressor target_rate": raises(
        ValueError,
        lambda: ComposedCompressor([], target_rate=1.5),
        "ComposedCompressor.target_rate=1.5 is out of range; allowed [0.0, 0.95]",
    ),
    "ComposedCompressor rate_scale": raises(
        ValueError,
        lambda: ComposedCompressor([], rate_scale=-0.1),
        "ComposedCompressor.rate_scale=-0.1 is out of range; allowed [0.0, 1.0]",
    ),
    "ComposedCompressor window": raises(
        ValueError,
        lambda: ComposedCompressor([], window=0),
        "ComposedCompressor.window=0 is out of range; allowed an integer in [1, inf)",
    ),
    "ComposedCompressor similarity": raises(
        ValueError,
        lambda: ComposedCompressor([], similarity="values"),
        "ComposedCompressor.similarity='values' is not allowed; choose one of ['keys', 'kv']",
    ),
    "UniCacheConfig target_rate": raises(
        ConfigError,
        lambda: UniCacheConfig.from_dict({"target_rate": 1.5}),
        "UniCacheConfig.target_rate=1.5 is out of range; allowed [0.0, 0.95]",
    ),
    "XKVConfig reduction": raises(
        ConfigError,
        lambda: XKVConfig(rank_mode="reduction", reduction=0.5),
        "XKVConfig.reduction=0.5 is out of range; allowed [1.0, 64.0]",
    ),
    "XKVConfig unknown field": raises(
        ConfigError,
        lambda: XKVConfig.from_dict({"ratio": 4.0}),
        "unknown field(s) ['ratio'] in XKVConfig; known: [",
    ),
    "RunConfig unknown xkv field": raises(
        ConfigError,
        lambda: RunConfig.from_dict({"compress": {"xkv": {"ratio": 4.0}}}),
        "unknown field(s) ['ratio'] in compress.xkv; known: [",
    ),
    "CompressionTrainConfig mapping": raises(
        ConfigError,
        lambda: CompressionTrainConfig(unicache={"target_rate": 0.5}),
        "CompressionTrainConfig.unicache={'target_rate': 0.5}: expected a UniCacheConfig (a "
        "mapping of overrides goes through CompressionTrainConfig.from_dict)",
    ),
    "UniCacheCompressor curriculum_steps": raises(
        ValueError,
        lambda: UniCacheCompressor(curriculum_steps=-1),
        "ComposedCompressor.curriculum_steps=-1 is out of range; allowed an integer in [0, inf)",
    ),
    # the model forward and generation
    "split negative": raises(
        ValueError,
        _forward(torch.tensor([-5, 3])),
        "split=[-5, 3] is out of range; allowed [0, T] = [0, 8] per sample",
    ),
    "split past the end": raises(
        ValueError,
        _forward(torch.tensor([3, 9])),
        "split=[3, 9] is out of range; allowed [0, T] = [0, 8]",
    ),
    "split float tensor": raises(
        ValueError,
        _forward(torch.tensor([2.5, 3.0])),
        "split has dtype torch.float32: expected an integer tensor of shape [B] = [2]",
    ),
    "split python float": raises(
        ValueError,
        _forward(3.5),
        "split=3.5: expected an integer tensor of shape [B] = [2], got float",
    ),
    "split shape": raises(
        ValueError, _forward(torch.tensor([1, 2, 3])), "split has shape (3,): expected [B] = [2]"
    ),
    "split without compressor": raises(
        ValueError,
        lambda: _model()(torch.zeros(2, 8, dtype=torch.long), split=torch.tensor([3, 3])),
        "split and compressor go together: pass both or neither",
    ),
    "generate top_k": raises(
        ValueError,
        lambda: _model().generate(torch.zeros(1, 3, dtype=torch.long), 2, temperature=1.0, top_k=0),
        "top_k=0 is out of range; allowed None or an integer in [1, inf)",
    ),
    "generate max_new_tokens": raises(
        ValueError,
        lambda: _model().generate(torch.zeros(1, 3, dtype=torch.long), -3),
        "max_new_tokens=-3 is out of range; allowed an integer in [0, inf)",
    ),
    "generate temperature": raises(
        ValueError,
        lambda: _model().generate(torch.zeros(1, 3, dtype=torch.long), 2, temperature=math.inf),
        "temperature=inf is out of range; allowed [0, inf)",
    ),
}


@pytest.mark.parametrize("case", list(API_CASES))
def test_python_api_bad_input(case: str) -> None:
    exc, fn, fragment = API_CASES[case]
    with pytest.raises(exc) as info:
        fn()
    assert fragment in str(info.value), str(info.value)


def test_split_edges_are_allowed() -> None:
    """0 (no context) and T (no continuation) are valid splits."""
    model = _model()
    ids = torch.zeros(2, 8, dtype=torch.long)
    with torch.no_grad():
        out = model(ids, split=torch.tensor([0, 8]), compressor=IdentityCompressor())
        plain = model(ids)
    # Nothing is compressed, so either edge computes the plain forward.
    torch.testing.assert_close(out.logits, plain.logits)


def test_empty_dataset_file_names_the_file(files) -> None:
    from unicache_train.data.datamodule import LMDataModule

    with pytest.raises(ConfigError, match="has no records"):
        LMDataModule(DataConfig(source=files["empty"])).setup()
    blank = Path(files["dir"]) / "blank.jsonl"
    blank.write_text('{"text": ""}\n{"text": ""}\n')
    with pytest.raises(ConfigError, match=r"has no records: no non-empty text in its 'text'"):
        LMDataModule(DataConfig(source=str(blank))).setup()


def test_only_bad_input_is_shortened_bugs_keep_their_traceback(capsys) -> None:
    """``report_user_errors`` prints one line for our config errors (also when a parser wrapped
    them, ``raise ... from``) and lets every other exception through, even one raised while
    handling a bad-input error."""
    from unicache_train.cli import report_user_errors

    def wrapped():
        try:
            raise ConfigError("X.y=1 is out of range; allowed [2, 3]")
        except ConfigError as err:
            raise ValueError("Does not validate against any of the Union subtypes") from err

    with pytest.raises(SystemExit) as exc:
        report_user_errors(wrapped)
    assert exc.value.code == 2
    assert capsys.readouterr().err == "error: X.y=1 is out of range; allowed [2, 3]\n"

    def bug_while_handling():
        try:
            raise FileNotFoundError("cache.json")
        except FileNotFoundError:
            raise TypeError("a bug")  # noqa: B904 (the point: an implicit __context__)

    with pytest.raises(TypeError, match="a bug"):
        report_user_errors(bug_while_handling)
    with pytest.raises(KeyError):
        report_user_errors(lambda: {}["k"])
