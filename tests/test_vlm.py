"""Vision-language path: the vision tower, visual tokens in the decoder, the synthetic scenes,
local (image, text) files, the LightningModule with compression in the loop, compressed-cache
decoding from prompt embeddings, and the per-task evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from unicache_train.compress import IdentityCompressor, UniCacheCompressor, UniCacheConfig
from unicache_train.data.multimodal import (
    MultimodalCollator,
    MultimodalDataConfig,
    MultimodalDataModule,
    encode_sample,
    load_multimodal_tokenizer,
)
from unicache_train.data.scenes import (
    _RELATIONS,
    IMAGE_MARK,
    TASKS,
    SceneConfig,
    make_sample,
    scene_samples,
    scene_words,
)
from unicache_train.data.tokenizer import ByteTokenizer
from unicache_train.eval.vlm import (
    VLMEvalConfig,
    evaluate_vlm,
    format_vlm_table,
    variant_config,
    write_vlm_outputs,
)
from unicache_train.model.config import ModelConfig
from unicache_train.model.generate import decode_teacher_forced
from unicache_train.model.vision import VisionConfig, patchify
from unicache_train.model.vlm import VisionLanguageModel
from unicache_train.train.vlm import (
    VLMModule,
    VLMRunConfig,
    answer_exact_match,
    fit_vlm,
    load_vlm_checkpoint,
)
from unicache_train.validation import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SCENES = SceneConfig(image_size=32, cell_size=8, max_shapes=3, max_describe=2)
TOK = ByteTokenizer()


def tiny_vlm(seed: int = 0, freeze: bool = False) -> VisionLanguageModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
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
        freeze_encoder=freeze,
    )
    return VisionLanguageModel(cfg, vis)


def tiny_run(tmp_path: Path, **compress) -> VLMRunConfig:
    return VLMRunConfig.from_dict(
        {
            "model": {
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            },
            "vision": {
                "image_size": 32,
                "patch_size": 8,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            },
            "data": {
                "batch_size": 4,
                "scenes": {
                    "image_size": 32,
                    "cell_size": 8,
                    "max_shapes": 3,
                    "max_describe": 2,
                    "num_train": 64,
                    "num_val": 8,
                    "images_per_sample": [1, 2],
                },
            },
            "train": {
                "max_steps": 3,
                "val_every_n_steps": 3,
                "limit_val_batches": 1,
                "checkpoint_every_n_steps": 3,
                "accelerator": "cpu",
                "warmup_steps": 1,
                "out_dir": str(tmp_path / "run"),
                "progress_bar": False,
                "log_every_n_steps": 1,
            },
            "logging": {"logger": "csv"},
            "monitor": {"gain": False},
            "compress": compress,
        }
    )


# ----------------------------------------------------------------------------- vision tower
def test_patchify_is_row_major() -> None:
    x = torch.zeros(1, 3, 16, 16)
    x[0, :, 8:16, 0:8] = 1.0  # bottom-left patch
    p = patchify(x, 8)
    assert p.shape == (1, 4, 3 * 64)
    assert p[0, 2].eq(1).all() and p[0, [0, 1, 3]].eq(0).all()


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("patch_size", 0, "[1, 48]"),
        ("num_hidden_layers", -1, "[0, 64]"),
        ("projector", "conv", "['mlp', 'linear']"),
    ],
)
def test_vision_config_errors_name_field_value_range(field, value, allowed) -> None:
    with pytest.raises(ConfigError) as err:
        VisionConfig(**{field: value})
    assert f"VisionConfig.{field}={value!r}" in str(err.value) and allowed in str(err.value)
    with pytest.raises(ConfigError, match="not a multiple of patch_size"):
        VisionConfig(image_size=50, patch_size=8)


def test_visual_tokens_land_at_vision_positions_in_order() -> None:
    """Two rows: one with an image in the middle, one with two images (the second at the end);
    each run of modality-1 positions receives that image's projected patches."""
    model = tiny_vlm()
    P = model.patches_per_image
    T = 2 * P + 12
    ids = torch.randint(0, 256, (2, T))
    mod = torch.zeros(2, T, dtype=torch.long)
    mod[0, 5 : 5 + P] = 1
    mod[1, 1 : 1 + P] = 1
    mod[1, T - P :] = 1
    pix = torch.rand(2, 2, 3, 32, 32)
    mask = torch.tensor([[True, False], [True, True]])
    emb = model.embed(ids, mod, pix, mask)
    tok = model.image_tokens(pix.flatten(0, 1)).view(2, 2, P, -1)
    torch.testing.assert_close(emb[0, 5 : 5 + P], tok[0, 0])
    torch.testing.assert_close(emb[1, 1 : 1 + P], tok[1, 0])
    torch.testing.assert_close(emb[1, T - P :], tok[1, 1])
    torch.testing.assert_close(emb[0, :5], model.embed_tokens(ids[0, :5]))
    # The forward with pixel_values equals the decoder on those embeddings.
    out = model(ids, pixel_values=pix, image_mask=mask, modality_ids=mod).logits
    torch.testing.assert_close(out, model(inputs_embeds=emb, modality_ids=mod).logits)
    with pytest.raises(ValueError, match=r"row 0: 16 positions .* 2 image\(s\)"):
        model.embed(ids, mod, pix, torch.tensor([[True, True], [True, True]]))
    with pytest.raises(ValueError, match="no pixel_values"):
        model(ids, modality_ids=mod)
    with pytest.raises(ValueError, match="expected \\[B, 3, 32, 32\\]"):
        model.image_tokens(torch.rand(1, 3, 48, 48))


def test_frozen_encoder_gets_no_gradient_projector_does() -> None:
    model = tiny_vlm(freeze=True)
    P = model.patches_per_image
    ids = torch.randint(0, 256, (1, P + 4))
    mod = torch.zeros_like(ids)
    mod[0, 2 : 2 + P] = 1
    model(ids, pixel_values=torch.rand(1, 3, 32, 32), modality_ids=mod).logits.sum().backward()
    assert all(p.grad is None for p in model.vision_tower.parameters())
    assert all(not p.requires_grad for p in model.vision_tower.parameters())
    assert model.projector.net[0].weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- scenes
def test_scenes_are_deterministic_and_answers_follow_the_scene() -> None:
    a, b = make_sample(SCENES, 3, 11), make_sample(SCENES, 3, 11)
    assert a["prompt"] == b["prompt"] and a["answer"] == b["answer"]
    assert all(np.array_equal(x, y) for x, y in zip(a["images"], b["images"]))
    assert make_sample(SCENES, 4, 11)["prompt"] != a["prompt"] or not np.array_equal(
        make_sample(SCENES, 4, 11)["images"][0], a["images"][0]
    )
    samples = scene_samples(SCENES, 60, 5, list(TASKS))
    assert [s["task"] for s in samples[:3]] == list(TASKS)
    for s in samples:
        assert s["prompt"].count(IMAGE_MARK) == len(s["images"]) == 1
        assert s["images"][0].shape == (3, 32, 32) and s["images"][0].dtype == np.float32
        first = {"describe": "a ", "count": "there ", "refer": "it is "}[s["task"]]
        assert s["answer"].startswith(first)  # the lead-in: informative tokens come later


def test_refer_answer_is_unique_and_redundant_background() -> None:
    """Recompute the referring answer from the scene: the only shape on that side."""
    from unicache_train.data.scenes import _refer_scene

    cfg = SceneConfig()  # 48 x 48, 6 x 6 cells
    rng = np.random.default_rng(0)
    for _ in range(50):
        scene, ref, tgt, rel = _refer_scene(cfg, rng, 4)
        dr, dc = _RELATIONS[rel]
        on_ray = [
            s
            for s in scene.shapes
            for k in range(1, 6)
            if (s.row, s.col) == (ref.row + dr * k, ref.col + dc * k)
        ]
        assert on_ray == [tgt]
        assert sum(s.name == ref.name for s in scene.shapes) == 1
    # Most patches are background: near-duplicates of a neighbour.
    img = make_sample(cfg, 0, 0)["images"][0]
    patches = patchify(torch.from_numpy(img)[None], 8)[0]  # [36, 192]
    d = torch.cdist(patches, patches)
    d.fill_diagonal_(float("inf"))
    assert (d.min(1).values < 1.0).float().mean() > 0.6


def test_word_tokenizer_covers_the_scene_language() -> None:
    tok = load_multimodal_tokenizer("words")
    assert tok.vocab_size == len(scene_words()) + 4
    cfg = SceneConfig(images_per_sample=[1, 3])
    for i in range(300):
        s = make_sample(cfg, 1, i)
        for text in (*s["prompt"].split(IMAGE_MARK), s["answer"]):
            ids = tok.encode(text)
            assert tok.unk_token_id not in ids
            assert tok.decode(ids) == text.strip()
    ids = tok.encode("a zebra?", add_bos=True, add_eos=True)
    assert ids[2] == tok.unk_token_id and ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special=False) == "<bos> a <unk>? <eos>"
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


def test_multi_image_prompts() -> None:
    cfg = SceneConfig(image_size=32, cell_size=8, max_shapes=3, images_per_sample=[2, 3])
    for i in range(10):
        s = make_sample(cfg, 1, i)
        n = len(s["images"])
        assert 2 <= n <= 3 and s["prompt"].count(IMAGE_MARK) == n
        assert f"in image {s['target_image'] + 1}," in s["prompt"]
    with pytest.raises(ConfigError, match="images_per_sample"):
        SceneConfig(images_per_sample=[2, 1])
    with pytest.raises(ConfigError, match="tasks"):
        SceneConfig(tasks=["caption"])


# ----------------------------------------------------------------------------- batches
def test_encode_and_collate_labels_split_and_pixels() -> None:
    P = 16
    s = make_sample(
        SceneConfig(image_size=32, cell_size=8, max_shapes=3, images_per_sample=[2, 2]), 0, 3
    )
    enc = encode_sample(s["prompt"], s["answer"], 2, TOK, P, "answer")
    assert int((enc["modality"] == 1).sum()) == 2 * P
    assert TOK.decode(enc["ids"][enc["answer_start"] :].tolist()) == s["answer"]
    q = encode_sample(s["prompt"], s["answer"], 2, TOK, P, "question")
    assert q["split"] < q["answer_start"] and enc["split"] == enc["answer_start"]
    assert (q["modality"][q["split"] :] == 0).all() and q["modality"][q["split"] - 1] == 1
    one = make_sample(SCENES, 0, 4)
    enc1 = encode_sample(one["prompt"], one["answer"], 1, TOK, P)
    batch = MultimodalCollator(TOK.pad_token_id, 512, False, 32)(
        [
            {**enc, "images": s["images"], "task_id": 2},
            {**enc1, "images": one["images"], "task_id": 0},
        ]
    )
    assert batch["pixel_values"].shape == (2, 2, 3, 32, 32)
    assert batch["image_mask"].tolist() == [[True, True], [True, False]]
    lab = batch["labels"][0]
    scored = torch.nonzero(lab != -100).flatten()
    assert int(scored[0]) == enc["answer_start"] - 1  # first answer token, from the prompt's end
    assert TOK.decode(lab[scored].tolist()) == s["answer"]
    assert (batch["labels"][batch["modality_ids"].roll(-1, 1) == 1] == -100).all()
    with pytest.raises(ValueError, match="max_seq_len"):
        MultimodalCollator(TOK.pad_token_id, 16, False, 32)(
            [{**enc, "images": s["images"], "task_id": 0}]
        )
    with pytest.raises(ValueError, match="mark"):
        encode_sample("no image here", "x", 1, TOK, P)


def _write_images(root: Path, n: int) -> list[dict]:
    from PIL import Image

    rows = []
    for i in range(n):
        s = make_sample(SCENES, 9, i)
        arr = (s["images"][0].transpose(1, 2, 0) * 255).astype(np.uint8)
        Image.fromarray(arr).resize((40, 40)).save(root / f"img{i}.png")
        q = s["prompt"].replace(IMAGE_MARK, "").strip()
        rows.append(
            {
                "file_name": f"img{i}.png",
                "question": q,
                "answer": s["answer"],
                "task": s["task"],
                "text": f"caption {i}",
            }
        )
    return rows


def test_local_imagefolder_and_parquet(tmp_path: Path) -> None:
    """(image, text) data from local files through HF datasets: an imagefolder with
    metadata.jsonl (question/answer) and a parquet file with image bytes and captions."""
    import datasets

    folder = tmp_path / "folder"
    folder.mkdir()
    rows = _write_images(folder, 6)
    with (folder / "metadata.jsonl").open("w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    cfg = MultimodalDataConfig(
        source=str(folder), batch_size=3, val_fraction=0.34, tokenizer="byte"
    )  # free text: captions, questions
    dm = MultimodalDataModule(cfg, image_size=32, patches_per_image=16)
    dm.setup()
    assert len(dm.train_dataset) == 4 and len(dm.val_dataset) == 2
    batch = next(iter(dm.train_dataloader()))
    assert batch["pixel_values"].shape == (3, 1, 3, 32, 32)
    assert 0.0 <= float(batch["pixel_values"].min()) and float(batch["pixel_values"].max()) <= 1
    assert set(batch["task_ids"].tolist()) <= {0, 1, 2}
    b0 = batch["labels"][0]
    answer = TOK.decode(b0[b0 != -100].tolist())
    assert answer in {r["answer"] for r in rows}

    # parquet: an image column of encoded bytes plus a caption (no question/answer pair).
    table = {
        "image": [{"bytes": (folder / r["file_name"]).read_bytes(), "path": None} for r in rows],
        "text": [r["text"] for r in rows],
    }
    datasets.Dataset.from_dict(table).to_parquet(str(tmp_path / "caps.parquet"))
    cfg = MultimodalDataConfig(
        source=str(tmp_path / "caps.parquet"), batch_size=2, val_fraction=0.0, tokenizer="byte"
    )
    dm = MultimodalDataModule(cfg, image_size=32, patches_per_image=16)
    dm.setup()
    item = dm.train_dataset[0]
    assert TOK.decode(item["ids"][: item["answer_start"]].tolist()).endswith("describe the image. ")
    assert TOK.decode(item["ids"][item["answer_start"] :].tolist()).startswith("caption ")
    with pytest.raises(FileNotFoundError):
        MultimodalDataModule(
            MultimodalDataConfig(source=str(tmp_path / "missing.parquet")), 32, 16
        ).setup()
    with pytest.raises(ConfigError, match="image_column='img'"):
        MultimodalDataModule(
            MultimodalDataConfig(source=str(tmp_path / "caps.parquet"), image_column="img"), 32, 16
        ).setup()


# ----------------------------------------------------------------------------- inference
def test_compressed_decoding_from_embeds_matches_the_in_loop_forward() -> None:
    """Prefill (images through inputs_embeds) -> compress -> decode on the real int8 cache gives
    the in-loop forward's logits on the answer, as for text."""
    model = tiny_vlm(seed=1).eval()
    samples = scene_samples(SCENES, 3, 2, list(TASKS))
    encs = [encode_sample(s["prompt"], s["answer"], 1, TOK, 16) for s in samples]
    T = max(len(e["ids"]) for e in encs)
    ids = torch.full((3, T), TOK.pad_token_id)
    mod = torch.zeros(3, T, dtype=torch.long)
    for b, e in enumerate(encs):
        ids[b, : len(e["ids"])] = torch.from_numpy(e["ids"])
        mod[b, : len(e["ids"])] = torch.from_numpy(e["modality"])
    pix = torch.stack([torch.from_numpy(s["images"][0]) for s in samples])
    split = torch.tensor([e["answer_start"] for e in encs])
    comp = UniCacheCompressor(UniCacheConfig())
    with torch.no_grad():
        ref = model(ids, pixel_values=pix, modality_ids=mod, split=split, compressor=comp).logits
        emb = model.embed(ids, mod, pix)
        dec, cache = decode_teacher_forced(
            model, ids, split, comp, modality_ids=mod, inputs_embeds=emb
        )
    for b, e in enumerate(encs):
        s, L = int(split[b]), len(e["ids"])
        torch.testing.assert_close(
            dec[b, s - 1 : L - 1], ref[b, s - 1 : L - 1], rtol=1e-4, atol=1e-4
        )
    assert cache.kv_bytes() < cache.baseline_bytes(model.config.head_size)


def test_evaluate_vlm_rows_and_outputs(tmp_path: Path) -> None:
    model = tiny_vlm(seed=2)
    opts = VLMEvalConfig(
        rates=[0.3, 0.6],
        variants=["text_style", "unicache"],
        num_per_task=2,
        batch_size=4,
        progress=False,
    )
    rows = evaluate_vlm(model, TOK, SCENES, UniCacheConfig(), opts)
    assert [r["variant"] for r in rows] == ["uncompressed"] + ["text_style"] * 2 + ["unicache"] * 2
    unc = rows[0]
    assert unc["kv_reduction"] == 1.0 and unc["rate_realized/vision"] == 0.0 and unc["n"] == 6
    for r in rows[1:]:
        assert 0 < r["rate_realized/vision"] < 1 and 0 <= r["rate_realized/text"] < 1
        assert r["kv_reduction"] > 1 / 0.6  # int8 and fewer entries
        assert all(0 <= r[f"acc/{t}"] <= 1 for t in TASKS)
    # UniCache compresses vision harder than text; the text-style baseline uses one rate.
    uc = rows[4]
    assert uc["rate_realized/vision"] > uc["rate_realized/text"]
    assert "global" == variant_config(UniCacheConfig(), "text_style", 0.6).importance.normalize
    assert "text_style" in format_vlm_table(rows)
    csv_path, png = write_vlm_outputs(rows, tmp_path, "t")
    assert csv_path.read_text().count("\n") == 6 and png.stat().st_size > 0
    with pytest.raises(ConfigError, match="variants"):
        VLMEvalConfig(variants=["h2o"])
    with pytest.raises(ConfigError, match="rates"):
        VLMEvalConfig(rates=[1.5])


# ----------------------------------------------------------------------------- training
def test_answer_exact_match() -> None:
    logits = torch.zeros(2, 3, 5)
    logits[0, 1, 2] = logits[1, 1, 2] = 1.0
    logits[1, 2, 4] = 1.0
    labels = torch.tensor([[-100, 2, -100], [-100, 2, 3]])
    assert answer_exact_match(logits, labels).tolist() == [True, False]


def test_run_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="image_size=32 must equal vision.image_size=48"):
        VLMRunConfig.from_dict({"data": {"scenes": {"image_size": 32, "cell_size": 8}}})
    with pytest.raises(ConfigError, match="unknown section"):
        VLMRunConfig.from_dict({"visual": {}})
    with pytest.raises(ConfigError, match="unknown field"):
        VLMRunConfig.from_dict({"data": {"scenes": {"colours": 3}}})
    cfg = VLMRunConfig.load(ROOT / "recipes" / "vlm_tiny.yaml", ["train.max_steps=7"])
    assert cfg.train.max_steps == 7 and cfg.vision.num_patches == 36
    assert VLMRunConfig.from_dict(cfg.to_dict()) == cfg


def test_vlm_module_in_loop_compression_fit_and_reload(tmp_path: Path) -> None:
    """The LightningModule trains with UniCache in the loop (splits at the answer, KL,
    curriculum), validates per task, checkpoints, and the checkpoint reloads."""
    cfg = tiny_run(tmp_path, enabled=True, kl_weight=0.5, curriculum_steps=2)
    trainer = fit_vlm(cfg)
    assert trainer.global_step == 3
    metrics = trainer.callback_metrics
    assert "val/answer_acc" in metrics and "val/ppl_compressed" in metrics
    assert "compress/rate_realized/vision" in metrics
    model, loaded = load_vlm_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert loaded == cfg and isinstance(model, VisionLanguageModel)
    # The module's compressed loss reaches the vision tower.
    module = VLMModule(cfg)
    dm = MultimodalDataModule(cfg.data, 32, 16)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    loss, logs, per_layer = module.compressed_loss(batch, step=10)
    loss.backward()
    assert module.model.vision_tower.patch_embed.weight.grad.abs().sum() > 0
    assert len(per_layer) == 2 and float(logs["compress/rate_realized/vision"]) > 0.0


def test_vision_pretraining_learns_patches_and_loads_as_init_weights(tmp_path: Path) -> None:
    from unicache_train.data.scenes import NUM_CELL_CLASSES, cell_labels
    from unicache_train.model.vision import VisionEncoder
    from unicache_train.train.vision_pretrain import VisionPretrainConfig, pretrain_vision_tower

    s = make_sample(SCENES, 0, 0)
    lab = s["cell_labels"][0]
    assert lab.shape == (16,) and int((lab > 0).sum()) >= 1 and lab.max() < NUM_CELL_CLASSES
    torch.manual_seed(0)
    cfg = tiny_run(tmp_path)
    tower = VisionEncoder(cfg.vision)
    stats = pretrain_vision_tower(
        tower,
        cfg.data.scenes,
        VisionPretrainConfig(steps=40, batch_size=32, eval_images=32),
        save_to=tmp_path / "tower.safetensors",
        progress=False,
    )
    assert stats["patch_acc"] > 0.9  # background alone is ~0.85; shapes must be found too
    assert stats["shape_patch_acc"] > 0.2  # 20 classes: well above chance after 40 steps
    cfg.vision.init_weights = str(tmp_path / "tower.safetensors")
    cfg.vision.freeze_encoder = True
    module = VLMModule(cfg)
    torch.testing.assert_close(
        module.model.vision_tower.patch_embed.weight, tower.patch_embed.weight
    )
    assert not any(p.requires_grad for p in module.model.vision_tower.parameters())
    assert cell_labels  # exported
    with pytest.raises(ConfigError, match="init_weights"):
        VisionConfig(init_weights="tower.pt")
    with pytest.raises(ConfigError, match="one shape per patch"):
        pretrain_vision_tower(VisionEncoder(VisionConfig()), SCENES, progress=False)


def test_init_weights_from_a_text_decoder(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    cfg = tiny_run(tmp_path)
    text = VisionLanguageModel(cfg.model, cfg.vision)
    state = {
        k: v
        for k, v in text.state_dict().items()
        if not k.startswith(("vision_tower.", "projector.", "lm_head."))
    }
    save_file(state, str(tmp_path / "text.safetensors"))
    cfg.train.init_weights = str(tmp_path / "text.safetensors")
    module = VLMModule(cfg)
    torch.testing.assert_close(
        module.model.layers[1].mlp.up_proj.weight, text.layers[1].mlp.up_proj.weight
    )
    save_file({"bogus": torch.zeros(1)}, str(tmp_path / "bad.safetensors"))
    cfg.train.init_weights = str(tmp_path / "bad.safetensors")
    with pytest.raises(RuntimeError, match="does not fit the decoder"):
        VLMModule(cfg)


def test_uncompressed_reference_is_identity_decoding() -> None:
    """The evaluation's uncompressed row decodes on an identity-compressed cache, which is the
    plain model's greedy decoding."""
    from unicache_train.eval.vlm import answer_accuracy, build_prompts

    model = tiny_vlm(seed=3).eval()
    samples = scene_samples(SCENES, 3, 8, list(TASKS))
    (pb,) = build_prompts(samples, TOK, 16, 8)
    res = answer_accuracy(model, TOK, [pb], IdentityCompressor())
    with torch.no_grad():
        emb = model.embed(pb.input_ids, pb.modality_ids, pb.pixel_values, pb.image_mask)
        for b in range(3):
            n = int(pb.split[b])
            ids, x = pb.input_ids[b : b + 1, :n], emb[b : b + 1, :n]
            out = []
            logits = model(inputs_embeds=x, modality_ids=pb.modality_ids[b : b + 1, :n]).logits
            seq = x
            for _ in range(pb.max_answer_tokens + 1):
                nxt = int(logits[0, -1].argmax())
                out.append(nxt)
                if nxt == TOK.eos_token_id:
                    break
                seq = torch.cat([seq, model.embed_tokens(torch.tensor([[nxt]]))], 1)
                logits = model(inputs_embeds=seq).logits
            assert res["predictions"][b] == TOK.decode(out), (b, ids.shape)


# ----------------------------------------------------------------------------- recipe
def _recipe():
    import importlib

    return importlib.import_module("recipes.vlm_tiny")


def test_recipe_configs_load_and_merge() -> None:
    recipe = _recipe()
    opts, base = recipe.parse_args(
        [
            "train.max_steps=5",
            "recipe.num_per_task=3",
            "finetune.train.max_steps=4",
            "finetune.compress.kl_weight=0",
        ]
    )
    assert base.train.max_steps == 5 and opts.num_per_task == 3
    assert not base.compress.enabled
    ft = recipe.finetune_config(opts, base)
    assert ft.compress.enabled and ft.compress.kl_weight == 0 and ft.train.max_steps == 4
    assert ft.compress.unicache.budget.enabled and ft.compress.unicache.protect.enabled
    assert ft.model == base.model and ft.vision == base.vision
    grid = recipe.grid_configs(ft.compress.unicache, [0.65, 0.75], [0.25])
    assert grid["fixed v=0.75 t=0.25"].budget.vision_rate == 0.75
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['num_per_tasks'\] in recipe"):
        recipe.parse_args(["recipe.num_per_tasks=3"])


def test_recipe_end_to_end_tiny(tmp_path: Path) -> None:
    """Every stage of recipes/vlm_tiny.py on a minute model: train, evaluate, fine-tune,
    evaluate, rate grid, tables, plots and the claims report."""
    recipe = _recipe()
    out = recipe.main(
        [
            f"train.out_dir={tmp_path / 'base'}",
            "train.max_steps=2",
            "train.val_every_n_steps=2",
            "train.limit_val_batches=1",
            "train.progress_bar=false",
            "data.batch_size=4",
            "model.hidden_size=32",
            "model.intermediate_size=48",
            "model.num_hidden_layers=2",
            "vision.hidden_size=16",
            "vision.intermediate_size=16",
            "vision.num_hidden_layers=1",
            "logging.logger=csv",
            "finetune.train.max_steps=2",
            f"finetune.train.out_dir={tmp_path / 'ft'}",
            "finetune.train.val_every_n_steps=2",
            "finetune.train.limit_val_batches=1",
            "recipe.num_per_task=2",
            "recipe.eval_batch_size=6",
            "recipe.rates=[0.3,0.6]",
            "recipe.grid_vision=[0.65,0.8]",
            "recipe.grid_text=[0.25]",
            "recipe.vision_steps=5",
        ]
    )
    res = tmp_path / "results"
    for name in (
        "vlm_eval.csv",
        "vlm_eval.md",
        "vlm_eval.png",
        "vlm_rate_grid.csv",
        "vlm_rate_grid.png",
        "claims.md",
    ):
        assert (res / name).stat().st_size > 0, name
    variants = {(r["model"], r["variant"]) for r in out["rows"]}
    assert ("finetuned", "unicache") in variants and ("base", "text_style") in variants
    assert ("finetuned_control", "unicache") in variants  # the plain fine-tune control
    cells = [g for g in out["grid"] if g["variant"] != "uncompressed"]
    assert len(cells) == 6  # base, base without protection, fine-tuned: 2 x 1 rates each
    assert {g["model"] for g in cells} == {"base", "base, no protection", "finetuned"}
