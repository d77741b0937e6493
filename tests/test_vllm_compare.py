"""experiments/vllm/vllm_compare.py without vLLM: the prompt set, the transformers reference loop
and the token-by-token comparison (the vLLM half needs .venv-vllm and is run by
``make vllm-compare``)."""

from __future__ import annotations

import csv
import importlib
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "vllm" / "vllm_compare.py"


@pytest.fixture(scope="module")
def vc():
    return importlib.import_module("experiments.vllm.vllm_compare")


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    """Our byte tokenizer in HF form, with a small chat template (no hub)."""
    from transformers import AutoTokenizer

    from unicache_train.checkpoint.serving import byte_tokenizer_files

    d = tmp_path_factory.mktemp("tok")
    byte_tokenizer_files(d)
    tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    return tok


def test_first_divergence(vc):
    assert vc.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert vc.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert vc.first_divergence([4, 2], [1, 2]) == 0
    assert vc.first_divergence([1, 2], [1, 2, 3]) == 2  # a shorter sequence diverges at its end
    assert vc.first_divergence([], []) is None


def _rec(pid, tokens, gaps, match=True):
    return {"id": pid, "tokens": tokens, "gaps": gaps, "tokenization_match": match}


def test_compare_records_rows_and_summary(vc):
    prompts = [
        {"id": "a", "kind": "text", "prompt_token_ids": [1, 2]},
        {"id": "b", "kind": "chat", "prompt_token_ids": [1, 2, 3]},
    ]
    ref = [_rec("a", [5, 6, 7, 8], [1.0, 2.0, 0.5, 3.0]), _rec("b", [9, 9], [0.1, 0.2])]
    got = [_rec("b", [9, 9], [0.1, 0.2], False), _rec("a", [5, 6, 4, 8], [1.0, 2.0, 0.4, 3.0])]
    rows = vc.compare_records("m", prompts, ref, got)
    a, b, total = rows
    assert (a["exact"], a["first_divergence"], a["matched_prefix"]) == (0, 2, 2)
    assert (a["ref_token_at_div"], a["vllm_token_at_div"]) == (7, 4)
    assert (a["ref_gap_at_div"], a["vllm_gap_at_div"]) == ("0.5", "0.4")
    assert a["min_ref_gap"] == "0.5"
    assert float(a["max_gap_diff"]) == pytest.approx(0.1)  # steps 0..2 (the divergence included)
    assert (b["exact"], b["first_divergence"], b["vllm_tokenization_match"]) == (1, "", "0")
    assert total["prompt"] == "ALL" and total["exact"] == "0.5000"
    assert total["matched_prefix"] == f"{(2 + 2) / 6:.4f}"  # matched tokens / generated tokens
    assert total["first_divergence"] == "min 2"
    assert total["vllm_tokenization_match"] == "1/2"
    assert float(total["max_gap_diff"]) == pytest.approx(0.1)
    assert set(a) == set(vc.COLUMNS)


def test_compare_records_names_a_missing_prompt(vc):
    prompts = [{"id": "a", "kind": "text", "prompt_token_ids": [1]}]
    with pytest.raises(ValueError, match="'a' is missing from the vllm results"):
        vc.compare_records("m", prompts, [_rec("a", [1], [0.1])], [])


def test_build_prompts_fixed_and_retokenizable(vc, byte_tok):
    recs = vc.build_prompts(byte_tok)
    assert recs == vc.build_prompts(byte_tok)  # deterministic
    assert len(recs) == 20 and len({r["id"] for r in recs}) == 20
    assert [r["kind"] for r in recs].count("recall") == 10
    bos = byte_tok.bos_token_id
    for r in recs:
        ids = r["prompt_token_ids"]
        if r["kind"] == "recall":
            # The evaluation's framing: [bos] + context + question, the answer not in the prompt.
            assert ids[0] == bos and r["text"].endswith(":") and r["answer"].isdigit()
            assert bytes(ids[1:]).decode() == r["text"]
        elif r["kind"] == "text":
            assert bytes(ids).decode() == r["text"]  # no special tokens added
        else:
            assert bytes(ids).decode() == f"user: {r['text']}\nassistant:"
        # The vLLM side re-tokenizes from the text alone and must get the same ids.
        assert vc._vllm_ids(byte_tok, r) == ids


def test_greedy_reference_loop_matches_generate(vc):
    """The reference loop (argmax on transformers' own cache) is transformers' greedy decode."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg).eval()
    ids = [3, 17, 5, 40, 9]
    greedy = GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        toks, gaps = vc._greedy_hf(model, ids, 12)
        mask = torch.ones(1, len(ids), dtype=torch.long)
        gen = model.generate(torch.tensor([ids]), attention_mask=mask, generation_config=greedy)
        logits = model(torch.tensor([ids + toks])).logits[0, len(ids) - 1 : -1]
    assert toks == gen[0, len(ids) :].tolist()
    top = logits.topk(2, dim=-1).values
    assert gaps == pytest.approx((top[:, 0] - top[:, 1]).tolist(), abs=1e-4)


def test_compare_cli_writes_csv(vc, tmp_path):
    prompts = [{"id": "a", "kind": "text", "prompt_token_ids": [1]}]
    files = {}
    for name, recs in (
        ("p", prompts),
        ("r", [_rec("a", [1, 2], [0.3, 0.2])]),
        ("v", [_rec("a", [1, 2], [0.3, 0.2])]),
    ):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(x) + "\n" for x in recs))
    out = tmp_path / "out.csv"
    for _ in range(2):  # appends, one header
        vc.main(
            [
                "compare",
                "--name",
                "m",
                "--prompts",
                str(files["p"]),
                "--reference",
                str(files["r"]),
                "--vllm",
                str(files["v"]),
                "--out",
                str(out),
            ]
        )
    rows = list(csv.DictReader(out.open()))
    assert [r["prompt"] for r in rows] == ["a", "ALL", "a", "ALL"]
    assert rows[1]["exact"] == "1.0000"


def test_pad_mla_state_dict_keeps_the_logits(vc):
    """Zero latent directions (plus the latent norm's rescale) leave a DeepseekV3's logits as
    they were: the padding that fits an export to vLLM's CPU MLA kernel is exact."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    kw = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        first_k_dense_replace=2,
        n_routed_experts=1,
        n_shared_experts=1,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        max_position_embeddings=64,
    )
    src = DeepseekV3ForCausalLM(DeepseekV3Config(kv_lora_rank=12, **kw)).eval()
    for m in src.modules():  # non-trivial latent norm weights
        if m.__class__.__name__ == "DeepseekV3RMSNorm":
            m.weight.data.uniform_(0.5, 1.5)
    padded = DeepseekV3ForCausalLM(DeepseekV3Config(kv_lora_rank=20, **kw)).eval()
    sd = vc.pad_mla_state_dict(src.state_dict(), 12, 20)
    padded.load_state_dict(sd, strict=True)
    ids = torch.tensor([[5, 9, 33, 2, 17, 40, 11]])
    with torch.no_grad():
        torch.testing.assert_close(padded(ids).logits, src(ids).logits, atol=1e-4, rtol=1e-4)
    assert sd["model.layers.0.self_attn.kv_b_proj.weight"][:, 12:].abs().max() == 0
    with pytest.raises(ValueError, match="below the export's kv_lora_rank=12"):
        vc.pad_mla_state_dict(src.state_dict(), 12, 8)


def test_pad_mla_rope_keeps_the_logits(vc):
    """A wider shared RoPE head (zero rows for the extra, slower frequencies, rope_theta raised
    so the used frequencies stay, queries rescaled for the softmax scale) leaves a DeepseekV3's
    logits as they were, checked with transformers' own model; then the latent padding on top."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    kw = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        v_head_dim=8,
        first_k_dense_replace=2,
        kv_lora_rank=12,
        n_routed_experts=1,
        n_shared_experts=1,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        max_position_embeddings=64,
        rope_interleave=True,
        initializer_range=0.2,
    )
    src_cfg = DeepseekV3Config(qk_rope_head_dim=4, rope_theta=100.0, **kw)
    src = DeepseekV3ForCausalLM(src_cfg).eval()
    sd, cfg = vc.pad_mla_rope_state_dict(src.state_dict(), src_cfg.to_dict(), 8)
    assert cfg["qk_rope_head_dim"] == 8
    assert (cfg.get("rope_parameters") or cfg)["rope_theta"] == pytest.approx(100.0**2)
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
    wide = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg)).eval()
    wide.load_state_dict(sd, strict=True)
    ids = torch.tensor([[5, 9, 33, 2, 17, 40, 11, 3, 60, 7]])
    with torch.no_grad():
        ref = src(ids).logits
        torch.testing.assert_close(wide(ids).logits, ref, atol=1e-4, rtol=1e-4)
        assert (ref - ref.mean()).abs().max() > 0.1  # the logits are not trivially flat
    with pytest.raises(ValueError, match="even and >= qk_rope_head_dim=4"):
        vc.pad_mla_rope_state_dict(src.state_dict(), src_cfg.to_dict(), 2)


def test_preflight_names_what_vllm_gets_wrong(vc):
    mla = {
        "model_type": "deepseek_v3",
        "tie_word_embeddings": True,
        "kv_lora_rank": 256,
        "qk_rope_head_dim": 64,
    }
    got = vc.preflight(mla, {"model.embed_tokens.weight"})
    assert len(got) == 3
    assert "lm_head.weight" in got[0] and "rotary_embedding" in got[1] and "= 320" in got[2]
    ok = {**mla, "kv_lora_rank": 512}
    names = {"model.embed_tokens.weight", "lm_head.weight"}
    assert vc.preflight(ok, names, "all,-rotary_embedding") == []
    assert len(vc.preflight(ok, names)) == 1  # the rotary kernel, when it is left on
    assert vc.preflight({"model_type": "llama", "tie_word_embeddings": True}, set()) == []
