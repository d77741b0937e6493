"""A small ViT-style vision encoder and the projector that turns its output into decoder tokens.

Shape legend: B, N, P, Cv, C, p = images, images per row (flattened into B here), patches per
image, vision width, decoder width, patch side in pixels.

::

    pixels [B, 3, H, W] ─► patchify (p x p, no overlap) [B, P, 3 p p] ─► patch_embed ─► + pos
        ─► VisionBlock x num_hidden_layers (bidirectional attention + SwiGLU, pre-norm)
        ─► post_layernorm [B, P, Cv] ─► Projector (Linear, GELU, Linear) [B, P, C]

One visual token per patch (no pooling): a 48 x 48 image with 8 x 8 patches is 36 tokens, most
of them background, which is the redundancy UniCache's vision budget is meant to exploit
(the UniCache article §1, §2.2). The projector is the LLaVA two-layer MLP (Liu et al., arXiv
2310.03744). Pure PyTorch, no Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from unicache_train.model.mlp import SwiGLU
from unicache_train.model.norm import RMSNorm
from unicache_train.validation import ConfigError, check_choice, check_int, check_range

__all__ = ["VisionConfig", "VisionEncoder", "Projector", "patchify"]


@dataclass
class VisionConfig:
    """The vision tower and projector.

    Attributes:
        image_size: side of the (square) input images in pixels.
        patch_size: side of a patch; ``image_size`` must be a multiple of it.
        num_channels: input channels (3: RGB in [0, 1]).
        hidden_size: width of the vision transformer (Cv).
        intermediate_size: SwiGLU width of its MLPs.
        num_hidden_layers: vision transformer blocks (0: patch embedding + projector only).
        num_attention_heads: heads of its bidirectional attention (must divide ``hidden_size``).
        projector: ``"mlp"`` (Linear, GELU, Linear; LLaVA-1.5) or ``"linear"``.
        freeze_encoder: keep the vision tower (patch embedding, blocks, final norm) frozen:
            no gradient, not in the optimizer. The projector still trains.
        init_weights: a ``.safetensors`` file of pretrained tower weights (names relative to
            the tower, e.g. from :func:`~unicache_train.train.vision_pretrain.
            pretrain_vision_tower`), loaded by the training module before training.
        rms_norm_eps: epsilon of the tower's RMSNorms.
        initializer_range: std of the normal init of its linear weights and position table.
    """

    image_size: int = 48
    patch_size: int = 8
    num_channels: int = 3
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    projector: str = "mlp"
    freeze_encoder: bool = False
    init_weights: str | None = None
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        check_int(self, "image_size", 1, 4096)
        check_int(self, "patch_size", 1, self.image_size)
        if self.image_size % self.patch_size:
            raise ConfigError(
                f"VisionConfig.image_size={self.image_size} is not a multiple of "
                f"patch_size={self.patch_size}"
            )
        check_int(self, "num_channels", 1, 16)
        check_int(self, "hidden_size", 1)
        check_int(self, "intermediate_size", 1)
        check_int(self, "num_hidden_layers", 0, 64)
        check_int(self, "num_attention_heads", 1, self.hidden_size)
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"VisionConfig.num_attention_heads={self.num_attention_heads} must divide "
                f"hidden_size={self.hidden_size}"
            )
        check_choice(self, "projector", ("mlp", "linear"))
        if not isinstance(self.freeze_encoder, bool):
            raise ConfigError(
                f"VisionConfig.freeze_encoder={self.freeze_encoder!r}: expected true or false"
            )
        if self.init_weights is not None and (
            not isinstance(self.init_weights, str) or not self.init_weights.endswith(".safetensors")
        ):
            raise ConfigError(
                f"VisionConfig.init_weights={self.init_weights!r}: expected None or the path of "
                "a .safetensors file of vision tower weights"
            )
        check_range(self, "rms_norm_eps", 0, 1, lo_open=True)
        check_range(self, "initializer_range", 0, 1, lo_open=True)

    @property
    def grid_size(self) -> int:
        """Patches per image side."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        """Visual tokens per image (P)."""
        return self.grid_size**2


def patchify(pixels: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[B, c, H, W] -> [B, P, c * p * p], patches in row-major order (top-left first)."""
    B, c, H, W = pixels.shape
    p = patch_size
    x = pixels.reshape(B, c, H // p, p, W // p, p)  # [B, c, gh, p, gw, p]
    x = x.permute(0, 2, 4, 1, 3, 5)  # [B, gh, gw, c, p, p]
    return x.reshape(B, (H // p) * (W // p), c * p * p)  # [B, P, c p p]


class VisionAttention(nn.Module):
    """Bidirectional multi-head self-attention over the patches of one image."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        C = config.hidden_size
        self.qkv_proj = nn.Linear(C, 3 * C, bias=True)
        self.o_proj = nn.Linear(C, C, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, P, Cv] -> [B, P, Cv]."""
        B, P, C = x.shape
        H = self.num_heads
        qkv = self.qkv_proj(x).view(B, P, 3, H, C // H).permute(2, 0, 3, 1, 4)  # [3, B, H, P, d]
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # [B, H, P, d]
        return self.o_proj(out.transpose(1, 2).reshape(B, P, C))


class VisionBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        C = config.hidden_size
        self.input_layernorm = RMSNorm(C, config.rms_norm_eps)
        self.self_attn = VisionAttention(config)
        self.post_attention_layernorm = RMSNorm(C, config.rms_norm_eps)
        self.mlp = SwiGLU(C, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, P, Cv] -> [B, P, Cv]."""
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class VisionEncoder(nn.Module):
    """Patch embedding + learned position table + bidirectional blocks + final norm."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        c, p = config.num_channels, config.patch_size
        self.patch_embed = nn.Linear(c * p * p, config.hidden_size)
        self.position_embedding = nn.Parameter(torch.zeros(config.num_patches, config.hidden_size))
        self.layers = nn.ModuleList(VisionBlock(config) for _ in range(config.num_hidden_layers))
        self.post_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        std = config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        nn.init.normal_(self.position_embedding, std=std)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: [B, c, H, W] (values in [0, 1]) -> patch features [B, P, Cv]."""
        cfg = self.config
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (
            cfg.num_channels,
            cfg.image_size,
            cfg.image_size,
        ):
            raise ValueError(
                f"pixel_values of shape {tuple(pixels.shape)}: expected [B, {cfg.num_channels}, "
                f"{cfg.image_size}, {cfg.image_size}] (VisionConfig.num_channels, image_size)"
            )
        # Centre the [0, 1] pixels so the patch embedding starts unbiased.
        x = self.patch_embed(patchify(pixels - 0.5, cfg.patch_size))  # [B, P, Cv]
        x = x + self.position_embedding.to(x.dtype)
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Projector(nn.Module):
    """Vision features [.., Cv] -> decoder embeddings [.., C] (``mlp``: Linear, GELU, Linear)."""

    def __init__(self, config: VisionConfig, out_size: int, initializer_range: float) -> None:
        super().__init__()
        if config.projector == "mlp":
            self.net: nn.Module = nn.Sequential(
                nn.Linear(config.hidden_size, out_size),
                nn.GELU(),
                nn.Linear(out_size, out_size),
            )
        else:
            self.net = nn.Linear(config.hidden_size, out_size)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=initializer_range)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
