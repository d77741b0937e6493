"""The ``unicache-train`` command line.

Each subcommand is a plain function; its typed signature and docstring make the CLI
(jsonargparse). Every subcommand accepts ``--config FILE.yaml`` (the recipe YAMLs in
``recipes/``) and dotted overrides such as ``--train.max_steps 50``.
"""

from __future__ import annotations

import sys

from unicache_train.config import (
    ConfigError,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    MonitorConfig,
    RunConfig,
    TrainConfig,
)


def fit(
    model: ModelConfig = ModelConfig(),  # noqa: B008  (jsonargparse reads these defaults)
    data: DataConfig = DataConfig(),  # noqa: B008
    train: TrainConfig = TrainConfig(),  # noqa: B008
    logging: LoggingConfig = LoggingConfig(),  # noqa: B008
    monitor: MonitorConfig = MonitorConfig(),  # noqa: B008
) -> None:
    """Train (or resume) a model: pretraining from scratch on the bundled synthetic corpus by
    default. Writes checkpoints and the resolved config.yaml under ``train.out_dir``.

    Args:
        model: decoder architecture (HF field names; residual_mode residual|mhc|hc).
        data: data source ('synthetic' or local files), tokenizer, sequence length, batch size.
        train: optimisation, hardware (accelerator/devices/strategy/precision), checkpoints,
            resume ('auto' or a .ckpt path).
        logging: logger (wandb offline by default, csv, tensorboard, none) and run metadata.
        monitor: per-layer signal-gain monitor (interval, 2x threshold, stop rule, plots) and
            compression-quality logging interval.
    """
    from unicache_train.train.run import fit as run_fit

    run_fit(RunConfig(model=model, data=data, train=train, logging=logging, monitor=monitor))


def evaluate(
    checkpoint: str,
    data: DataConfig | None = None,
    limit_batches: int = 50,
) -> dict[str, float]:
    """Evaluate a checkpoint: validation loss and perplexity.

    Args:
        checkpoint: a ``.ckpt`` written by ``unicache-train fit``.
        data: data to evaluate on (default: the data section saved with the checkpoint).
        limit_batches: evaluate at most this many validation batches.
    """
    from unicache_train.checkpoint import load_checkpoint
    from unicache_train.data.datamodule import LMDataModule
    from unicache_train.train.evaluate import evaluate_perplexity

    model, config = load_checkpoint(checkpoint)
    dm = LMDataModule(data or config.data)
    dm.setup("validate")
    result = evaluate_perplexity(model, dm.val_dataloader(), limit_batches)
    print(f"val loss {result.loss:.4f}  ppl {result.ppl:.3f}  "
          f"({result.tokens} tokens, {result.batches} batches)")
    return {"loss": result.loss, "ppl": result.ppl}


def generate(
    checkpoint: str,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
) -> str:
    """Generate a continuation of ``prompt`` with a checkpoint (greedy when temperature is 0).

    Args:
        checkpoint: a ``.ckpt`` written by ``unicache-train fit``.
        prompt: the text to continue.
        max_new_tokens: number of tokens to generate.
        temperature: sampling temperature (0 = greedy).
        top_k: sample among the k most likely tokens.
        seed: sampling seed.
    """
    import torch

    from unicache_train.checkpoint import load_checkpoint
    from unicache_train.data.tokenizer import load_tokenizer

    model, config = load_checkpoint(checkpoint)
    tok = load_tokenizer(config.data.tokenizer)
    ids = torch.tensor([tok.encode(prompt, add_bos=True)])
    gen = torch.Generator().manual_seed(seed)
    out = model.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k,
                         eos_token_id=tok.eos_token_id, generator=gen)
    text = tok.decode(out[0, ids.shape[1]:].tolist())
    print(prompt + text)
    return text


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``unicache-train`` console script."""
    from jsonargparse import CLI

    try:
        CLI(
            {"fit": fit, "pretrain": fit, "evaluate": evaluate, "generate": generate},
            args=argv,
            description="unicache_train: mHC hyper-connections and compression-aware "
            "KV-cache fine-tuning. Run `unicache-train SUBCOMMAND --help` for details.",
        )
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
