"""Every export path writes a directory that serves as it is (issue 17, item 5): stock
``AutoTokenizer.from_pretrained(dir)`` + ``AutoModelForCausalLM.from_pretrained(dir)`` load it and
``generate`` gives the source model's greedy ids; tokenizer files, ``generation_config.json`` and
the chat template come from the source (or our byte tokenizer, in HF form, for runs trained on
it)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from unicache_train.checkpoint.gguf import CheckpointNotFetched, fetched_dir  # noqa: E402
from unicache_train.checkpoint.hf import export_hf, import_hf  # noqa: E402
from unicache_train.checkpoint.serving import CHAT_TEMPLATE_FILES  # noqa: E402
from unicache_train.data.config import DataConfig  # noqa: E402
from unicache_train.data.tokenizer import ByteTokenizer  # noqa: E402
from unicache_train.model import Decoder  # noqa: E402
from unicache_train.model.config import ModelConfig  # noqa: E402
from unicache_train.train.config import RunConfig  # noqa: E402

V = 272  # >= the test tokenizer's 261 tokens and the byte tokenizer's 260
COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPT = "the cat sat on the mat and the dog"
MESSAGES = [{"role": "user", "content": "hello world, the cat"}]
NEW_TOKENS = 8


def _auto(path, **kw):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, **kw)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()
    return tok, model


@torch.no_grad()
def _hf_greedy(model, tok, text=PROMPT):
    enc = tok(text, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, enc["input_ids"].shape[1] :].tolist()


@torch.no_grad()
def _our_greedy(model: Decoder, ids: list[int], eos: int | None) -> list[int]:
    out = model.eval().generate(torch.tensor([ids]), NEW_TOKENS, eos_token_id=eos)
    new = out[0, len(ids) :].tolist()
    return new[: new.index(eos) + 1] if eos in new else new  # HF stops at eos; ours repeats it


def _assert_serves(out: Path, *, chat: bool):
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (out / name).is_file(), name
    assert any((out / n).is_file() for n in CHAT_TEMPLATE_FILES) == chat


# ------------------------------------------------------------------------------ sources
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A small trained byte-level BPE tokenizer with a chat template (not ours)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=261,
        special_tokens=["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(
        ["the cat sat on the mat", "hello world, the dog ran home"] * 8, trainer
    )
    path = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=TEMPLATE,
    ).save_pretrained(path)
    return path


def _hf_config(family: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    base = dict(COMMON, rope_theta=500.0, bos_token_id=1, eos_token_id=2)
    return {
        "llama": lambda: LlamaConfig(**base, tie_word_embeddings=False),
        "qwen2": lambda: Qwen2Config(**base, tie_word_embeddings=True),
        "qwen3": lambda: Qwen3Config(**base, head_dim=24, tie_word_embeddings=False),
        "mistral": lambda: MistralConfig(**base, sliding_window=None, tie_word_embeddings=False),
    }[family]()


def _source(family: str, path: Path, tokenizer_dir: Path) -> Path:
    """A tiny random HF checkpoint (``save_pretrained``: generation_config.json included) with
    the test tokenizer and its chat template."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_hf_config(family)).eval()
    with torch.no_grad():  # O(1) logits: random greedy paths, not a constant token
        for p in hf.parameters():
            p.normal_(0.0, 0.3 if p.dim() > 1 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    hf.save_pretrained(path)
    shutil.copytree(tokenizer_dir, path, dirs_exist_ok=True)
    return path


def _check_against_source(out: Path, src: Path, *, trust_remote_code: bool = False):
    """Files present and verbatim; tokenizer and chat template equal; greedy ids equal."""
    _assert_serves(out, chat=True)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    cfg, src_cfg = (json.loads((d / "config.json").read_text()) for d in (out, src))
    assert (
        [cfg[k] for k in ("bos_token_id", "eos_token_id")]
        == [1, 2]
        == [src_cfg[k] for k in ("bos_token_id", "eos_token_id")]
    )
    src_tok, src_model = _auto(src)
    tok, model = _auto(out, trust_remote_code=trust_remote_code)
    assert tok(PROMPT)["input_ids"] == src_tok(PROMPT)["input_ids"]
    chat = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert chat == src_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|assistant|>")
    want = _hf_greedy(src_model, src_tok)
    assert len(want) == NEW_TOKENS or want[-1] == 2  # generation really ran
    assert _hf_greedy(model, tok) == want
    assert _hf_greedy(model, tok, chat) == _hf_greedy(src_model, src_tok, chat)


# ------------------------------------------------------------------------ export_hf paths
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_export_hf_of_an_import_serves_with_the_source_tokenizer(family, tmp_path, tokenizer_dir):
    """import_hf records the source directory; export_hf copies its tokenizer, generation
    config and chat template without being told."""
    src = _source(family, tmp_path / "src", tokenizer_dir)
    model, _ = import_hf(src)
    export_hf(model, tmp_path / "out", family=family)
    _check_against_source(tmp_path / "out", src)


def test_mhc_export_serves_with_trust_remote_code(tmp_path, tokenizer_dir):
    """A converted model is a new module: the source is named with tokenizer_from."""
    from unicache_train.model.convert import convert_to_mhc

    src = _source("llama", tmp_path / "src", tokenizer_dir)
    model, _ = import_hf(src)
    torch.manual_seed(0)
    mhc = convert_to_mhc(model, hc_mult=2)
    export_hf(mhc, tmp_path / "out", tokenizer_from=src)
    assert (tmp_path / "out" / "modeling_unicache_mhc.py").is_file()
    _check_against_source(tmp_path / "out", src, trust_remote_code=True)
    # Our mHC export imports back with its own directory recorded: a re-export stays complete.
    again, _ = import_hf(tmp_path / "out")
    export_hf(again, tmp_path / "again")
    _check_against_source(tmp_path / "again", src, trust_remote_code=True)


def test_head_merged_export_keeps_the_source_tokenizer(tmp_path, tokenizer_dir):
    from unicache_train.checkpoint.head_merge import merge_kv_heads

    src = _source("llama", tmp_path / "src", tokenizer_dir)
    model, _ = import_hf(src)
    merged = merge_kv_heads(model, [[[0, 1]]] * 2)
    export_hf(merged, tmp_path / "out")
    _assert_serves(tmp_path / "out", chat=True)
    tok, back = _auto(tmp_path / "out")
    ids = tok(PROMPT)["input_ids"]
    assert _hf_greedy(back, tok) == _our_greedy(merged, ids, eos=2)


# --------------------------------------------------------------------- DeepseekV3 (MLA)
def test_deepseek_v3_export_of_an_import_serves(tmp_path, tokenizer_dir):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from unicache_train.checkpoint.deepseek_v3 import export_deepseek_v3, import_deepseek_v3

    cfg = DeepseekV3Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        first_k_dense_replace=2,
        n_routed_experts=1,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=1,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        max_position_embeddings=128,
        num_mtp_layers=0,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(cfg).eval().save_pretrained(tmp_path / "src")
    shutil.copytree(tokenizer_dir, tmp_path / "src", dirs_exist_ok=True)
    export_deepseek_v3(import_deepseek_v3(tmp_path / "src"), tmp_path / "out")
    _check_against_source(tmp_path / "out", tmp_path / "src")


def test_mla_conversion_exports_with_the_gqa_source_tokenizer(tmp_path, tokenizer_dir):
    from unicache_train.checkpoint.deepseek_v3 import export_deepseek_v3
    from unicache_train.model.convert_mla import convert_to_mla

    src = _source("llama", tmp_path / "src", tokenizer_dir)
    model, _ = import_hf(src)
    mla = convert_to_mla(model, torch.randint(0, V, (2, 16)), kv_lora_rank=16, qk_rope_head_dim=8)
    export_deepseek_v3(mla, tmp_path / "out", tokenizer_from=src)
    _assert_serves(tmp_path / "out", chat=True)
    tok, back = _auto(tmp_path / "out")
    assert _hf_greedy(back, tok) == _our_greedy(mla, tok(PROMPT)["input_ids"], eos=2)


# ---------------------------------------------------------------- unicache-train export
def _write_ckpt(path: Path, model_cfg: ModelConfig, tokenizer: str) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(model_cfg).eval()
    config = RunConfig(model=model_cfg, data=DataConfig(tokenizer=tokenizer))
    torch.save(
        {
            "hyper_parameters": {"config": config.to_dict()},
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        },
        path,
    )
    return model


@pytest.mark.parametrize("fmt", ["hf", "deepseek_v3"])
def test_cli_export_of_a_byte_tokenizer_run_serves(fmt, tmp_path):
    """A run trained from scratch on our byte tokenizer: its HF form tokenizes exactly as
    ByteTokenizer does, and the config / generation config carry its special ids."""
    from unicache_train.cli import main

    extra = (
        dict(
            attention_type="mla",
            num_key_value_heads=4,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
        )
        if fmt != "hf"
        else {}
    )
    model_cfg = ModelConfig(**{**COMMON, **extra}, initializer_range=0.2)
    model = _write_ckpt(tmp_path / "m.ckpt", model_cfg, "byte")
    out = tmp_path / "out"
    main(["export", "--checkpoint", str(tmp_path / "m.ckpt"), "--format", fmt, "--out", str(out)])
    _assert_serves(out, chat=False)
    byte = ByteTokenizer()
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 257, "eos_token_id": 258, "pad_token_id": 256}
    tok, back = _auto(out)
    for text in [PROMPT, "héllo wörld 🙂 <eos> <pad>\n\t", ""]:
        ids = tok(text)["input_ids"]
        assert ids == byte.encode(text), text
        assert tok.decode(ids) == byte.decode(ids)
    assert tok.decode([104, 258, 105], skip_special_tokens=True) == "hi"
    assert _hf_greedy(back, tok) == _our_greedy(model, byte.encode(PROMPT), eos=258)


def test_cli_export_of_an_hf_tokenizer_run_copies_it(tmp_path, tokenizer_dir):
    """data.tokenizer = the checkpoint directory (what prepare_hf_run sets): its tokenizer,
    generation config and chat template travel with the export."""
    from unicache_train.cli import main

    src = _source("qwen2", tmp_path / "src", tokenizer_dir)
    model, config = import_hf(src)
    torch.save(
        {
            "hyper_parameters": {
                "config": RunConfig(model=config, data=DataConfig(tokenizer=str(src))).to_dict()
            },
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        },
        tmp_path / "m.ckpt",
    )
    main(
        [
            "export",
            "--checkpoint",
            str(tmp_path / "m.ckpt"),
            "--family",
            "qwen2",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    _check_against_source(tmp_path / "out", src)


# ------------------------------------------------------------------------- the recipe
def test_finetune_hf_recipe_export_serves(tmp_path, tokenizer_dir, monkeypatch):
    import importlib

    src = _source("llama", tmp_path / "src", tokenizer_dir)
    recipe = importlib.import_module("recipes.finetune_hf")
    trainer = recipe.main(
        [
            "--checkpoint_dir",
            str(src),
            f"hf.export_dir={tmp_path / 'export'}",
            "hf.export_dtype=fp32",
            f"train.out_dir={tmp_path / 'run'}",
            "train.max_steps=1",
            "train.warmup_steps=0",
            "train.lr=0.001",
            "train.accelerator=cpu",
            "train.resume=null",
            "train.limit_val_batches=0",
            "train.progress_bar=false",
            "logging.logger=none",
            "monitor.gain=false",
            "monitor.plots=false",
            "data.seq_len=32",
            "data.batch_size=2",
            "data.synthetic.num_stories=20",
            "data.synthetic.num_recall=0",
        ]
    )
    out = tmp_path / "export"
    _assert_serves(out, chat=True)
    assert (out / "generation_config.json").read_bytes() == (
        src / "generation_config.json"
    ).read_bytes()
    tok, back = _auto(out)
    tuned = trainer.lightning_module.model.float()
    assert _hf_greedy(back, tok) == _our_greedy(tuned, tok(PROMPT)["input_ids"], eos=2)


# ------------------------------------------------------------------------- edge cases
def test_export_without_a_tokenizer_source_warns_and_writes_the_rest(tmp_path):
    model = Decoder(ModelConfig(**COMMON))
    with pytest.warns(UserWarning, match="tokenizer_from="):
        export_hf(model, tmp_path / "a", bos_token_id=1, eos_token_id=2)
    assert not (tmp_path / "a" / "tokenizer.json").exists()
    gen = json.loads((tmp_path / "a" / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2}
    with pytest.raises(FileNotFoundError, match="tokenizer_from="):
        export_hf(model, tmp_path / "b", tokenizer_from=tmp_path / "nowhere")
    with pytest.raises(TypeError, match="tokenizer_from has type int"):
        export_hf(model, tmp_path / "b", tokenizer_from=3)
    small = Decoder(ModelConfig(**{**COMMON, "vocab_size": 97}))
    with pytest.warns(UserWarning, match="260 tokens but the model's vocab_size is 97"):
        export_hf(small, tmp_path / "c", tokenizer_from="byte")
    assert json.loads((tmp_path / "c" / "generation_config.json").read_text()) == {}


def test_tokenizer_object_and_explicit_ids(tmp_path, tokenizer_dir):
    """A transformers tokenizer object is saved with save_pretrained (chat template included);
    explicit ids win over the source's in config.json and generation_config.json."""
    from transformers import AutoTokenizer

    model = Decoder(ModelConfig(**COMMON))
    export_hf(
        model,
        tmp_path / "out",
        tokenizer_from=AutoTokenizer.from_pretrained(tokenizer_dir),
        eos_token_id=4,
    )
    _assert_serves(tmp_path / "out", chat=True)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 4)
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 4}
    export_hf(model, tmp_path / "src2", tokenizer_from=tokenizer_dir)  # no config.json there:
    cfg = json.loads((tmp_path / "src2" / "config.json").read_text())  # the tokenizer's ids
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    export_hf(model, tmp_path / "src2", tokenizer_from=tmp_path / "src2")  # into its source


# ---------------------------------------------------------------------- real checkpoint
try:
    SMOLLM2 = fetched_dir("smollm2")
except CheckpointNotFetched as err:  # pragma: no cover - depends on the machine
    SMOLLM2, REASON = None, str(err)
else:
    REASON = ""


@pytest.mark.skipif(SMOLLM2 is None, reason=REASON)
@torch.no_grad()
def test_smollm2_export_serves_its_chat_template(tmp_path):
    """Import the real SmolLM2, export, reload with Auto* classes: the chat template applies and
    8 greedy tokens equal transformers' on the source directory."""
    model, _ = import_hf(SMOLLM2)
    out = export_hf(model, tmp_path / "out", family="llama")
    del model
    _assert_serves(out, chat=True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tokens = []
    for path in (SMOLLM2, out):
        tok, lm = _auto(path)
        enc = tok.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        assert enc["input_ids"].shape[1] > 20  # the template's system turn is there
        gen = lm.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False)
        tokens.append(gen[0, enc["input_ids"].shape[1] :].tolist())
        del lm
    assert len(tokens[0]) == NEW_TOKENS and tokens[1] == tokens[0]
