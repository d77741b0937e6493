"""PNG plots of signal gain (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def plot_gain(history: list[dict[str, Any]], out: str | Path, title: str | None = None) -> Path:
    """Per-layer forward/backward gain at the last check, and gains over training steps.

    Args:
        history: rows of :class:`~unicache_train.monitor.callbacks.SignalGainMonitor`
            (``step``, ``fwd`` [L], ``bwd`` [L], optional ``composite_fwd``/``composite_bwd``).
        out: PNG path (parent directories are created).

    Returns:
        The written path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        raise ValueError("plot_gain: empty history")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    last = history[-1]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    layers = list(range(len(last["fwd"])))
    ax1.plot(layers, last["fwd"], "o-", label="forward  rms(x_l+1)/rms(x_l)")
    ax1.plot(layers, last["bwd"], "s-", label="backward rms(g_l)/rms(g_l+1)")
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_xlabel("layer")
    ax1.set_ylabel("norm gain")
    ax1.set_title(f"per-layer gain at step {last['step']}")
    ax1.legend(fontsize=8)

    steps = [r["step"] for r in history]
    ax2.plot(steps, [max(r["fwd"]) for r in history], label="max per-layer fwd gain")
    ax2.plot(steps, [_nanmax(r["bwd"]) for r in history], label="max per-layer bwd gain")
    if any("composite_fwd" in r for r in history):
        rows = [r for r in history if "composite_fwd" in r]
        ax2.plot(
            [r["step"] for r in rows],
            [r["composite_fwd"] for r in rows],
            label="composite mix gain (fwd)",
        )
        ax2.plot(
            [r["step"] for r in rows],
            [r["composite_bwd"] for r in rows],
            "--",
            label="composite mix gain (bwd)",
        )
        ax2.set_yscale("log")
    ax2.set_xlabel("step")
    ax2.set_title("gain over training")
    ax2.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _nanmax(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return max(finite) if finite else float("nan")
