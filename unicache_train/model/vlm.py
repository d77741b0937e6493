"""A vision-language decoder: the text :class:`~unicache_train.model.Decoder` plus a vision tower
whose projected patch features enter through ``inputs_embeds`` with ``modality_ids = 1``.

Shape legend: B, T, N, P, C = batch, tokens, image slots per row, patches per image, width.

::

    input_ids [B, T]   (image positions hold any id, e.g. <pad>; modality_ids == 1 marks them)
        └─► embed_tokens ─────────────────────────────┐
    pixel_values [B, N, 3, H, W], image_mask [B, N]    ├─► masked_scatter ─► inputs_embeds [B, T, C]
        └─► vision_tower ─► projector [n_img, P, C] ──┘            │
                                                                   ▼
                              Decoder.forward(inputs_embeds, modality_ids, split, compressor)

Images may sit anywhere in a row and a row may hold several: the k-th real image of row b
(``image_mask[b]`` in order) fills the k-th run of ``P`` vision positions of that row, in order.
Everything downstream (the attention seam, the compressors, compressed-cache decoding) is the
decoder's and sees the visual tokens as modality 1, the same way it would see audio frames as
modality 2. The subclass keeps the decoder's parameter names (``embed_tokens``, ``layers.*``),
so text checkpoints load into it and optimizer groups and exports treat the decoder part
unchanged; the vision parameters live under ``vision_tower.*`` and ``projector.*``.
"""

from __future__ import annotations

import torch

from unicache_train.model.config import ModelConfig
from unicache_train.model.decoder import Decoder, DecoderOutput
from unicache_train.model.kv_cache import KVCache
from unicache_train.model.vision import Projector, VisionConfig, VisionEncoder
from unicache_train.seam import KVCompressor

__all__ = ["VisionLanguageModel", "VISION_MODALITY"]

#: ``modality_ids`` value of visual tokens (``MODALITY_NAMES[1] == "vision"``).
VISION_MODALITY = 1


class VisionLanguageModel(Decoder):
    """Decoder + vision tower + projector (LLaVA layout, Liu et al. arXiv 2304.08485).

    Args:
        config: the decoder's :class:`~unicache_train.model.config.ModelConfig`.
        vision: the :class:`~unicache_train.model.vision.VisionConfig`.
    """

    def __init__(self, config: ModelConfig, vision: VisionConfig) -> None:
        super().__init__(config)
        self.vision_config = vision
        self.vision_tower = VisionEncoder(vision)
        self.projector = Projector(vision, config.hidden_size, config.initializer_range)
        if vision.freeze_encoder:
            self.vision_tower.requires_grad_(False)

    @property
    def patches_per_image(self) -> int:
        return self.vision_config.num_patches

    def image_tokens(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values: [n, 3, H, W] -> projected visual tokens [n, P, C]."""
        if self.vision_config.freeze_encoder:
            with torch.no_grad():
                feats = self.vision_tower(pixel_values)
        else:
            feats = self.vision_tower(pixel_values)
        return self.projector(feats)

    def embed(
        self,
        input_ids: torch.Tensor,
        modality_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Text embeddings with the visual tokens written at the vision positions.

        Args:
            input_ids: [B, T].
            modality_ids: [B, T]; positions equal to 1 receive visual tokens.
            pixel_values: [B, N, 3, H, W] image slots (or [n, 3, H, W] for one image per row
                when ``image_mask`` is None), or None when no row holds an image.
            image_mask: [B, N] bool, real images among the slots (default: all).

        Returns:
            inputs_embeds [B, T, C].
        """
        x = self.embed_tokens(input_ids)  # [B, T, C]
        vis = modality_ids == VISION_MODALITY  # [B, T]
        P = self.patches_per_image
        if pixel_values is None:
            if bool(vis.any()):
                raise ValueError(
                    f"modality_ids mark {int(vis.sum())} vision positions but no pixel_values "
                    "were given"
                )
            return x
        if pixel_values.dim() == 4:  # [B, 3, H, W]: one image per row
            pixel_values = pixel_values[:, None]
        B, N = pixel_values.shape[:2]
        if B != input_ids.shape[0]:
            raise ValueError(
                f"pixel_values has {B} rows, input_ids {input_ids.shape[0]}: expected one row of "
                "image slots [N, 3, H, W] per sequence"
            )
        if image_mask is None:
            image_mask = torch.ones(B, N, dtype=torch.bool, device=pixel_values.device)
        if tuple(image_mask.shape) != (B, N):
            raise ValueError(
                f"image_mask of shape {tuple(image_mask.shape)}: expected [B, N] = {(B, N)}"
            )
        want = image_mask.sum(1) * P  # [B] vision positions each row must have
        have = vis.sum(1)
        if not torch.equal(want.to(have.device), have):
            bad = torch.nonzero(want.to(have.device) != have).flatten()[0].item()
            raise ValueError(
                f"row {bad}: {int(have[bad])} positions with modality_ids == 1 but "
                f"{int(image_mask[bad].sum())} image(s) x {P} patches = {int(want[bad])} visual "
                "tokens; put one run of patches_per_image placeholders per image"
            )
        if not bool(image_mask.any()):
            return x
        tokens = self.image_tokens(pixel_values[image_mask])  # [n_img, P, C]
        # NOTE: masked_scatter fills in row-major order: row b's images, in slot order, land on
        # row b's vision positions left to right.
        return x.masked_scatter(vis[..., None], tokens.to(x.dtype).reshape(-1, x.shape[-1]))

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        modality_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        split: torch.Tensor | None = None,
        compressor: KVCompressor | None = None,
        logits_at: torch.Tensor | None = None,
        reference_logits: bool = False,
        step: int | None = None,
    ) -> DecoderOutput:
        """As :meth:`Decoder.forward`, plus images.

        Args:
            pixel_values: [B, N, 3, H, W] image slots (see :meth:`embed`); needs ``input_ids``
                and ``modality_ids``.
            image_mask: [B, N] bool, real images among the slots.

        Returns:
            :class:`DecoderOutput` with logits [B, T, V] (also at vision positions, unused).
        """
        if pixel_values is not None:
            if inputs_embeds is not None or input_ids is None or modality_ids is None:
                raise ValueError(
                    "pixel_values need input_ids and modality_ids (and no inputs_embeds): the "
                    "vision positions are where modality_ids == 1"
                )
            inputs_embeds = self.embed(input_ids, modality_ids, pixel_values, image_mask)
            input_ids = None
        elif input_ids is not None and modality_ids is not None and cache is None:
            if bool((modality_ids == VISION_MODALITY).any()):
                raise ValueError("modality_ids mark vision positions but no pixel_values given")
        return super().forward(
            input_ids,
            inputs_embeds=inputs_embeds,
            modality_ids=modality_ids,
            positions=positions,
            cache=cache,
            split=split,
            compressor=compressor,
            logits_at=logits_at,
            reference_logits=reference_logits,
            step=step,
        )
