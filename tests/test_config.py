"""Config validation: errors name the field, the value and the allowed range."""

import pytest

from unicache_train.data.config import DataConfig
from unicache_train.model.config import ModelConfig
from unicache_train.train.config import LoggingConfig, RunConfig, TrainConfig
from unicache_train.validation import ConfigError


@pytest.mark.parametrize(
    "cls, kwargs, match",
    [
        (
            ModelConfig,
            {"hidden_size": 0},
            r"ModelConfig\.hidden_size=0 is out of range; allowed \[1",
        ),
        (ModelConfig, {"num_key_value_heads": 3}, r"num_key_value_heads=3 must divide"),
        (
            ModelConfig,
            {"num_key_value_heads": 8},
            r"num_key_value_heads=8 is out of range; allowed \[1, 4\]",
        ),
        (ModelConfig, {"hidden_size": 130}, r"hidden_size=130 is not divisible"),
        (
            ModelConfig,
            {"residual_mode": "mhcx"},
            r"residual_mode='mhcx' is not allowed; choose one of",
        ),
        (ModelConfig, {"hc_mult": 0}, r"hc_mult=0 is out of range"),
        (ModelConfig, {"rms_norm_eps": -1.0}, r"rms_norm_eps=-1.0 is out of range; allowed \(0"),
        (ModelConfig, {"vocab_size": 2.5}, r"vocab_size=2.5: expected an integer"),
        (DataConfig, {"seq_len": 1}, r"DataConfig\.seq_len=1 is out of range"),
        (DataConfig, {"val_fraction": 1.0}, r"val_fraction=1.0 is out of range; allowed \[0, 1\)"),
        (TrainConfig, {"lr": 0.0}, r"TrainConfig\.lr=0.0 is out of range; allowed \(0"),
        (TrainConfig, {"precision": "fp8"}, r"precision='fp8' is not allowed"),
        (TrainConfig, {"devices": 0}, r"devices=0: expected an integer >= 1 or 'auto'"),
        (LoggingConfig, {"logger": "mlflow"}, r"logger='mlflow' is not allowed"),
    ],
)
def test_bad_values_raise_clear_errors(cls, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        cls(**kwargs)


def test_head_dim_is_derived_until_set():
    cfg = ModelConfig(hidden_size=64, num_attention_heads=4)
    assert cfg.head_dim is None and cfg.head_size == 16
    assert ModelConfig(head_dim=24).head_size == 24


def test_yaml_round_trip_and_overrides(tmp_path):
    cfg = RunConfig(model=ModelConfig(hidden_size=64), train=TrainConfig(max_steps=7))
    path = cfg.save(tmp_path / "c.yaml")
    again = RunConfig.load(
        path, overrides=["train.lr=0.01", "model.residual_mode=mhc", "data.synthetic.seed=5"]
    )
    assert again.model.hidden_size == 64 and again.train.max_steps == 7
    assert again.train.lr == 0.01 and again.model.residual_mode == "mhc"
    assert again.data.synthetic.seed == 5
    assert RunConfig.load(path).to_dict() == cfg.to_dict()


def test_unknown_fields_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['hiden_size'\] in model"):
        RunConfig.from_dict({"model": {"hiden_size": 3}})
    with pytest.raises(FileNotFoundError, match="config file not found"):
        RunConfig.load(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="must look like section.field=value"):
        RunConfig.load(RunConfig().save(tmp_path / "c.yaml"), overrides=["train.lr"])


def test_importing_the_model_imports_no_compressor_and_no_training_code() -> None:
    """Configs live with their packages: the decoder and its config load without compress/,
    train/ (Lightning) or the run configuration."""
    import subprocess
    import sys

    code = (
        "import sys, unicache_train.model, unicache_train.model.config\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('unicache_train.compress',"
        " 'unicache_train.train', 'lightning')))\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing the model loaded: {out.stdout.strip()}"
