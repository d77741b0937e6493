"""Pretraining the vision tower on the synthetic scenes (per-patch classification).

Real vision-language models start from a pretrained image encoder (LLaVA: a frozen CLIP ViT,
then the projector and the LLM are trained). This is the small-scale analogue: the tower learns
to tell, for every patch, background from each (colour, kind) shape with a linear head on its
patch features (:func:`~unicache_train.data.scenes.cell_labels`; one shape per patch). The
decoder then starts from features that separate shapes from background, instead of having to
discover them through the language loss, which on CPU budgets stays on a long plateau where
answers follow the language prior only.

Shape legend: B, P, Cv, K = images, patches per image, tower width, classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from unicache_train.data.scenes import NUM_CELL_CLASSES, SceneConfig, make_sample
from unicache_train.model.vision import VisionEncoder
from unicache_train.validation import ConfigError
from unicache_train.validation import check_int as _int
from unicache_train.validation import check_range as _range

__all__ = ["VisionPretrainConfig", "pretrain_vision_tower", "scene_patch_batch"]


@dataclass
class VisionPretrainConfig:
    """Attributes:
    steps: optimizer steps.
    batch_size: images per step.
    lr: AdamW learning rate (constant after a 10-step warmup).
    seed: seed of the training images (distinct from the VLM's sample seeds).
    eval_images: held-out images for the reported patch accuracy.
    """

    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 4242
    eval_images: int = 256

    def __post_init__(self) -> None:
        _int(self, "steps", 1)
        _int(self, "batch_size", 1)
        _range(self, "lr", 0, 1, lo_open=True)
        _int(self, "seed", 0)
        _int(self, "eval_images", 1)


def scene_patch_batch(
    scenes: SceneConfig, seed: int, start: int, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``start .. start + n`` of stream ``seed`` (the first image of each sample) and
    their per-patch labels: pixels [n, 3, H, W], labels [n, P]."""
    samples = [make_sample(scenes, seed, i) for i in range(start, start + n)]
    pix = torch.from_numpy(np.stack([s["images"][0] for s in samples]))
    lab = torch.from_numpy(np.stack([s["cell_labels"][0] for s in samples]))
    return pix, lab


def pretrain_vision_tower(
    tower: VisionEncoder,
    scenes: SceneConfig,
    config: VisionPretrainConfig | None = None,
    *,
    save_to: str | Path | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """Train ``tower`` (in place) with a linear per-patch classifier on scene images.

    Args:
        tower: the vision encoder (its patch grid must be the scene's cell grid).
        scenes: the scene task (image size, cell size, shapes per image).
        config: steps, batch, lr, seed.
        save_to: write the tower's weights (``.safetensors``, names relative to the tower)
            here, for ``VisionConfig.init_weights``.
        progress: show a progress bar.

    Returns:
        ``patch_acc`` and ``shape_patch_acc`` (accuracy on the held-out patches that hold a
        shape) and the final training ``loss``.
    """
    cfg = config or VisionPretrainConfig()
    vc = tower.config
    if vc.image_size != scenes.image_size or vc.patch_size != scenes.cell_size:
        raise ConfigError(
            f"vision pretraining labels one shape per patch: vision.image_size={vc.image_size} "
            f"and patch_size={vc.patch_size} must equal data.scenes.image_size="
            f"{scenes.image_size} and cell_size={scenes.cell_size}"
        )
    torch.manual_seed(cfg.seed)
    head = nn.Linear(vc.hidden_size, NUM_CELL_CLASSES)
    tower.requires_grad_(True)
    tower.train()
    params = [*tower.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    # Backgrounds outnumber shapes ~10:1; weigh classes so shapes are not an afterthought.
    weight = torch.ones(NUM_CELL_CLASSES)
    weight[0] = 0.1
    loss_value = float("nan")
    steps = range(cfg.steps)
    bar = None
    if progress:
        from rich.progress import Progress

        bar = Progress(transient=True)
        bar.start()
        task = bar.add_task("pretraining the vision tower", total=cfg.steps)
    try:
        for step in steps:
            pix, lab = scene_patch_batch(scenes, cfg.seed, step * cfg.batch_size, cfg.batch_size)
            logits = head(tower(pix))  # [B, P, K]
            loss = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), weight=weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_value = float(loss.detach())
            if bar is not None:
                bar.advance(task)
    finally:
        if bar is not None:
            bar.stop()
    tower.eval()
    with torch.no_grad():
        pix, lab = scene_patch_batch(scenes, cfg.seed + 1, 0, cfg.eval_images)
        pred = head(tower(pix)).argmax(-1)
    shape = lab > 0
    out = {
        "patch_acc": float((pred == lab).float().mean()),
        "shape_patch_acc": float((pred[shape] == lab[shape]).float().mean()),
        "loss": loss_value,
    }
    if save_to is not None:
        from safetensors.torch import save_file

        Path(save_to).parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tower.state_dict().items()}, str(save_to))
    return out
