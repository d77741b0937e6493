"""The shared compression matrix (tests/test_compress.py: every method) on multimodal batches:
real visual tokens of the VLM's vision tower (two images per row, at different places) and
audio-like frames (modality 2, smooth and redundant), through the decoder's attention seam.

Every call must keep the structural invariants, the per-modality budgets (each of text, vision
and audio), alignment protection and K/V pairing, and backpropagate finite gradients into the
vision tower. Plus the pooled (text-style) budget and the per-modality normalization claim on
visual tokens.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_compress import METHODS, Recorder, _check_state, _compressor

from unicache_train.compress import UniCacheCompressor, UniCacheConfig, presets
from unicache_train.compress.budget import pooled_rates
from unicache_train.compress.config import BudgetConfig, QuantizeConfig
from unicache_train.compress.testing import check_budget, check_segment
from unicache_train.data.scenes import SceneConfig, make_sample
from unicache_train.model.config import ModelConfig
from unicache_train.model.vision import VisionConfig
from unicache_train.model.vlm import VisionLanguageModel
from unicache_train.validation import ConfigError

P = 16  # 32 x 32 images, 8 x 8 patches


def tiny_vlm(seed: int = 0, layers: int = 3) -> VisionLanguageModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    vis = VisionConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    return VisionLanguageModel(cfg, vis)


def audio_frames(n: int, width: int, seed: int) -> torch.Tensor:
    """Audio-like embeddings [n, width]: a slowly drifting mixture of a few sinusoids through a
    random projection, so adjacent frames are near-duplicates (as speech frames at 50 Hz)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(n, dtype=torch.float32)[:, None]
    freq = torch.rand(1, 6, generator=g) * 0.15
    feats = torch.cat([torch.sin(freq * t), torch.cos(freq * t)], 1)  # [n, 12]
    return feats @ (0.05 * torch.randn(12, width, generator=g))


def multimodal_batch(model: VisionLanguageModel, seed: int = 0):
    """Rows: [bos text][image][text][audio x 10][text][image][question ...][answer ...].

    Returns (inputs_embeds [B, T, C], modality_ids [B, T], split [B]).
    """
    B, T = 3, 96
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    mod = torch.zeros(B, T, dtype=torch.long)
    mod[:, 3 : 3 + P] = 1
    mod[:, 24:34] = 2
    mod[:, 40 : 40 + P] = 1
    scenes = SceneConfig(image_size=32, cell_size=8, max_shapes=3, max_describe=3)
    pix = torch.stack(
        [
            torch.stack(
                [
                    torch.from_numpy(make_sample(scenes, seed, 2 * b + i)["images"][0])
                    for i in range(2)
                ]
            )
            for b in range(B)
        ]
    )  # [B, 2, 3, 32, 32]
    vis_only = torch.where(mod == 2, 0, mod)
    emb = model.embed(ids, vis_only, pix)
    audio = torch.stack([audio_frames(10, emb.shape[-1], seed + b) for b in range(B)])
    emb = emb.masked_scatter((mod == 2)[..., None], audio)
    split = torch.tensor([60, 75, 90])  # all three modalities in every context
    return emb, mod, split


@pytest.mark.parametrize("method", list(METHODS))
def test_matrix_multimodal_seam(method: str) -> None:
    """Every method of the shared matrix on images + audio-like frames through the seam."""
    model = tiny_vlm()
    emb, mod, split = multimodal_batch(model)
    cfg = METHODS[method]()
    mc = model.config
    rec = Recorder(
        _compressor(method, cfg, mc.num_key_value_heads, mc.head_size, mc.num_hidden_layers)
    )
    out = model(inputs_embeds=emb, modality_ids=mod, split=split, compressor=rec)
    assert len(rec.calls) == model.config.num_hidden_layers
    for inp, seg, state in rec.calls:
        check_segment(inp, seg)
        _check_state(state, cfg)
        if state is not None and state.plan is not None and state.modality_rates is not None:
            check_budget(state)  # per modality: text, vision and audio
    for stats in out.compression_stats:
        for key in ("rate_realized/text", "rate_realized/vision", "rate_realized/audio"):
            assert key in stats and 0.0 <= float(stats[key]) < 1.0
    # Gradients reach the vision tower through the compressed visual entries.
    out.logits[:, -10:].float().logsumexp(-1).mean().backward()
    g = model.vision_tower.patch_embed.weight.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0


def test_default_budgets_on_real_visual_tokens() -> None:
    """Full UniCache on visual + audio + text: vision loses more than text (density budgets,
    text capped at 0.40, vision at 0.80), every modality keeps at least one entry."""
    model = tiny_vlm(layers=4)
    emb, mod, split = multimodal_batch(model, seed=3)
    cfg = UniCacheConfig(quantize=QuantizeConfig(bits=None))
    rec = Recorder(UniCacheCompressor(cfg))
    model(inputs_embeds=emb, modality_ids=mod, split=split, compressor=rec)
    for _, seg, state in rec.calls:
        r = state.modality_rates
        assert (r[:, 0] <= 0.40 + 1e-6).all() and (r[:, 1] <= 0.80 + 1e-6).all()
        assert (r[:, 2] <= 0.60 + 1e-6).all()
        assert (r[:, 1] > r[:, 0]).all()  # redundant patches are compressed harder than text
        for m in range(3):
            assert ((seg.valid & (seg.modality_ids == m)).sum(1) >= 1).all()


def test_pooled_budget_is_one_global_ranking() -> None:
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.2, 0.05, 0.7, 0.3, 0.6]])
    mod = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 0]])
    mask = torch.ones_like(mod, dtype=torch.bool)
    rates = pooled_rates(scores, mod, mask, torch.tensor([0.5]))
    # The 4 lowest (0.05, 0.1, 0.2, 0.3) are three visual tokens and one audio frame.
    torch.testing.assert_close(rates, torch.tensor([[0.0, 1.0, 0.5]]))
    cfg = presets.text_style_pooled()
    assert cfg.budget.allocation == "pooled" and cfg.importance.normalize == "global"
    assert not cfg.protect.enabled
    with pytest.raises(ConfigError, match=r"BudgetConfig.allocation='global'"):
        BudgetConfig(allocation="global")


def test_global_normalization_pushes_visual_tokens_out_of_a_pooled_budget() -> None:
    """The UniCache article §2.3 on the mechanism: visual attention is diluted over many patches, so
    a global ranking puts visual tokens at the bottom and a pooled budget removes them first; the
    per-modality ranking does not."""
    model = tiny_vlm(layers=2)
    emb, mod, split = multimodal_batch(model, seed=5)
    removed = {}
    for normalize in ("global", "modality"):
        cfg = presets.text_style_pooled()
        cfg.importance.normalize = normalize
        cfg.quantize.bits = None
        cfg = UniCacheConfig.from_dict(cfg.to_dict())
        rec = Recorder(UniCacheCompressor(cfg))
        model(inputs_embeds=emb, modality_ids=mod, split=split, compressor=rec)
        removed[normalize] = float(
            torch.stack([s.modality_rates[:, 1] for _, _, s in rec.calls]).mean()
        )
    assert not math.isnan(removed["global"])
    assert removed["global"] > removed["modality"]
