"""Serving parity: do our exports load in vLLM and generate the tokens transformers generates?

Two environments exchange files (vLLM's CPU build pins its own torch and transformers; the
project's venv is never touched by it):

1. project venv: write the prompt set, tokenized once (``prompts``), optionally convert SmolLM2
   to MLA and export it as DeepseekV3 (``export-mla``), and generate the reference greedily with
   transformers (``reference``);
2. ``.venv-vllm`` (``experiments/vllm/vllm_env.sh``): generate greedily with vLLM on the CPU from the same
   prompt token ids (``vllm``); it also re-tokenizes each prompt with vLLM's tokenizer (and chat
   template) to check the text path gives the same ids;
3. either venv: compare token by token (``compare``), one CSV row per prompt plus a summary row.

::

    P=runs/vllm/prompts.jsonl
    .venv/bin/python experiments/vllm/vllm_compare.py prompts --tokenizer DIR --out $P
    .venv/bin/python experiments/vllm/vllm_compare.py reference --model DIR --prompts $P \\
        --out runs/vllm/NAME.hf.jsonl
    .venv-vllm/bin/python experiments/vllm/vllm_compare.py vllm --model DIR --prompts $P \\
        --out runs/vllm/NAME.vllm.jsonl
    .venv/bin/python experiments/vllm/vllm_compare.py compare --name NAME --prompts $P \\
        --reference runs/vllm/NAME.hf.jsonl --vllm runs/vllm/NAME.vllm.jsonl \\
        --out experiments/vllm/results/vllm_compare.csv

The prompt set (20 prompts, fixed): 10 held-out key-value recall prompts
(:mod:`unicache_train.data.recall_task`, the evaluation seed, ``[bos] + context + question``
framed as :mod:`unicache_train.eval.recall` frames them), 5 plain English prompts (no special
tokens) and 5 chat prompts (the tokenizer's chat template, generation prompt added). Both sides
decode greedily for ``--max-new-tokens`` tokens and never stop at EOS (vLLM ``ignore_eos``;
transformers: a plain argmax loop on its KV cache, no logits processors), so every sequence has
the same length and a mismatch is a real divergence. Each step also records the top-1 minus
top-2 logit gap (vLLM: of its returned log-probabilities, the same difference): a divergence at
a step whose gap is below the dtype's rounding noise is a near-tie, not a bug.
"""

from __future__ import annotations

import argparse
import csv
import inspect
import json
import os
import sys
import time
from pathlib import Path

# Plain English prompts (no special tokens): continuations with one clear greedy path and some
# open-ended ones, where near-ties are likely.
TEXT_PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea, there lived",
    "The three primary colors are",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
)
# Chat prompts (the model's chat template, generation prompt added).
CHAT_PROMPTS = (
    "What is the largest planet in the solar system?",
    "Write a haiku about autumn leaves.",
    "Explain in one sentence what a hash table is.",
    "List three fruits that are red.",
    "How many days are there in a leap year?",
)
RECALL_SEED = (
    1_000_003  # the held-out evaluation seed (experiments/kvpress/kvpress_baseline.py uses it too)
)


# ------------------------------------------------------------------------- project venv side
def build_prompts(tokenizer, n_recall: int = 10, pairs: int = 8) -> list[dict]:
    """The fixed prompt set as records ``{id, kind, text, add_bos, chat, prompt_token_ids}``.

    Args:
        tokenizer: a transformers tokenizer (the export's).
        n_recall: recall prompts (held-out seed, ``RecallTask(pairs=pairs)``).

    ``prompt_token_ids`` is what both engines are fed: recall prompts are
    ``[bos] + encode(context) + encode(question)`` (the evaluation's framing), text prompts
    ``encode(text)``, chat prompts the chat template's ids; ``encode`` never adds special tokens.
    """
    from unicache_train.data.recall_task import RecallTask, recall_records

    def enc(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    out: list[dict] = []
    bos = tokenizer.bos_token_id
    for i, r in enumerate(recall_records(RecallTask(pairs=pairs), n_recall, RECALL_SEED)):
        ids = ([bos] if bos is not None else []) + enc(r["context"]) + enc(r["question"])
        out.append(
            {
                "id": f"recall{i}",
                "kind": "recall",
                "text": r["context"] + r["question"],
                "add_bos": bos is not None,
                "chat": False,
                "answer": r["answer"],
                "prompt_token_ids": ids,
            }
        )
    for i, t in enumerate(TEXT_PROMPTS):
        out.append(
            {
                "id": f"text{i}",
                "kind": "text",
                "text": t,
                "add_bos": False,
                "chat": False,
                "prompt_token_ids": enc(t),
            }
        )
    for i, t in enumerate(CHAT_PROMPTS):
        ids = chat_ids(tokenizer, t)
        out.append(
            {
                "id": f"chat{i}",
                "kind": "chat",
                "text": t,
                "add_bos": False,
                "chat": True,
                "prompt_token_ids": ids,
            }
        )
    return out


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of one user turn under ``tokenizer``'s chat template (generation prompt added).

    transformers 4.x returns a list from ``apply_chat_template(tokenize=True)``, 5.x a
    ``BatchEncoding``; both are handled, so the two venvs can run this same function.
    """
    got = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    if hasattr(got, "keys") and "input_ids" in got:
        got = got["input_ids"]
    return [int(t) for t in got]


def write_prompts(args) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(args.tokenizer), local_files_only=True)
    recs = build_prompts(tok, args.recall)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    print(f"wrote {len(recs)} prompts to {args.out}")


def export_mla(args) -> None:
    """SmolLM2 (GQA) -> MLA (:func:`convert_to_mla`, no healing) -> DeepseekV3 export."""
    import torch

    from unicache_train.checkpoint.deepseek_v3 import export_deepseek_v3
    from unicache_train.checkpoint.hf import import_hf
    from unicache_train.data.reference_text import reference_documents
    from unicache_train.model.convert_mla import convert_to_mla_with_report

    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(args.source), local_files_only=True)
    model, _ = import_hf(args.source)
    # Calibration: held-in reference prose, packed into [B, T] sequences.
    ids: list[int] = []
    for doc in reference_documents("train"):
        ids += tok(doc, add_special_tokens=False)["input_ids"]
        if len(ids) >= args.calib_seqs * args.calib_len:
            break
    calib = torch.tensor(ids[: args.calib_seqs * args.calib_len]).view(args.calib_seqs, -1)
    t0 = time.time()
    if args.saved:  # a healed conversion (experiments/smollm2_mla/smollm2_mla.py --save-dir)
        from safetensors.torch import load_file

        from unicache_train.model import Decoder
        from unicache_train.model.config import ModelConfig

        stem = Path(args.saved)
        mla = Decoder(ModelConfig.from_dict(json.loads(stem.with_suffix(".json").read_text())))
        mla.load_state_dict(load_file(str(stem.with_suffix(".safetensors"))))
        mla.eval()
        print(
            f"loaded {stem}: kv_lora_rank {mla.config.kv_lora_rank}, qk_rope_head_dim "
            f"{mla.config.qk_rope_head_dim}"
        )
    else:
        mla, report = convert_to_mla_with_report(
            model, calib, args.kv_lora_rank, args.rope_dim, batch_size=2
        )
        print(
            f"converted in {time.time() - t0:.0f}s: rope stride {report.rope_stride}, "
            f"rope_theta {report.rope_theta:g}, KV elements/token/layer "
            f"{report.kv_elements_before} -> {report.kv_elements_after}"
        )
    with torch.no_grad():
        x = calib[:2, :128]
        labels = x[:, 1:].reshape(-1)
        for name, m in (("source", model), ("mla", mla)):
            logits = m(x).logits
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels
            )
            print(f"{name} calibration-text ppl {float(nll.exp()):.2f}")
    export_deepseek_v3(mla, args.out, tokenizer_from=args.source)
    print(f"exported {args.out}")
    # Stock transformers reloads it: DeepseekV3ForCausalLM logits against ours.
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(str(args.out), dtype=torch.float32).eval()
    with torch.no_grad():
        x = calib[:2, :128]
        ref = mla(x).logits
        diff = float((back(x).logits - ref).abs().max())
    print(
        f"transformers {type(back).__name__} reload: max |logit diff| {diff:.3g} "
        f"(logits up to {float(ref.abs().max()):.1f})"
    )


def pad_mla_state_dict(sd: dict, rank: int, new_rank: int) -> dict:
    """Widen a DeepseekV3 latent from ``rank`` to ``new_rank`` with zero directions, exactly.

    Per layer: ``kv_a_proj_with_mqa.weight`` [R + Dr, C] gets ``new_rank - R`` zero rows between
    the latent rows and the ``k_pe`` rows, ``kv_b_proj.weight`` [H (Dn + Dv), R] zero columns,
    and ``kv_a_layernorm.weight`` [R] is scaled by ``sqrt(R / new_rank)`` and zero-padded: the
    zero directions lower the latent's mean square by ``R / new_rank``, which the RMSNorm would
    otherwise turn into a ``sqrt(new_rank / R)`` gain (exact up to the norm's eps, which acts as
    ``eps * new_rank / R``). vLLM's CPU MLA decode kernel is compiled for
    ``kv_lora_rank + qk_rope_head_dim = 576`` only (DeepSeek's 512 + 64).

    Args:
        sd: the export's tensors (HF names); not modified.
        rank, new_rank: R and the padded rank (``new_rank >= rank``).
    """
    import torch

    if new_rank < rank:
        raise ValueError(f"--pad-rank={new_rank} is below the export's kv_lora_rank={rank}")
    out = dict(sd)
    pad = new_rank - rank
    for name, w in sd.items():
        if name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            zeros = w.new_zeros(pad, w.shape[1])
            out[name] = torch.cat([w[:rank], zeros, w[rank:]], dim=0)
        elif name.endswith("self_attn.kv_b_proj.weight"):
            out[name] = torch.cat([w, w.new_zeros(w.shape[0], pad)], dim=1)
        elif name.endswith("self_attn.kv_a_layernorm.weight"):
            scaled = w * (rank / new_rank) ** 0.5
            out[name] = torch.cat([scaled, w.new_zeros(pad)])
    return out


def pad_mla_rope_state_dict(sd: dict, cfg: dict, new_rope: int) -> tuple[dict, dict]:
    """Widen a DeepseekV3 export's shared RoPE head from ``Dr`` to ``new_rope`` dims, exactly.

    RoPE frequency ``j`` of a ``Dr``-dim head is ``theta^(-2j / Dr)``; with ``theta' = theta^(
    new_rope / Dr)`` the first ``Dr / 2`` frequencies of a ``new_rope``-dim head are the same
    numbers, and the export's interleaved layout keeps pair ``j`` at rows ``(2j, 2j + 1)``. So the
    ``k_pe`` rows of ``kv_a_proj_with_mqa`` and each head's ``q_pe`` rows of ``q_proj`` /
    ``q_b_proj`` get ``new_rope - Dr`` zero rows after them (slower frequencies nobody uses), and
    every query row is scaled by ``sqrt((Dn + new_rope) / (Dn + Dr))`` to undo the softmax
    scale's change (``(Dn + Dr)^-1/2``). Logits are unchanged up to rounding.

    Returns:
        (tensors, config) with ``qk_rope_head_dim``, ``rope_theta`` (and ``qk_head_dim``) updated.
    """
    import torch

    dr, dn = int(cfg["qk_rope_head_dim"]), int(cfg["qk_nope_head_dim"])
    if new_rope < dr or new_rope % 2:
        raise ValueError(f"--pad-rope={new_rope} must be even and >= qk_rope_head_dim={dr}")
    if not cfg.get("rope_interleave", True):
        raise ValueError("pad-rope expects the interleaved RoPE layout our export writes")
    rope = cfg.get("rope_parameters") or {}
    if (cfg.get("rope_scaling") or rope.get("rope_type", "default")) not in (None, "default"):
        raise ValueError("pad-rope supports default RoPE only (no rope_scaling)")
    heads, pad = int(cfg["num_attention_heads"]), new_rope - dr
    gain = ((dn + new_rope) / (dn + dr)) ** 0.5
    out = dict(sd)
    for name, w in sd.items():
        if name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            out[name] = torch.cat([w, w.new_zeros(pad, w.shape[1])], dim=0)
        elif name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            q = w.view(heads, dn + dr, w.shape[1])
            q = torch.cat([q, q.new_zeros(heads, pad, w.shape[1])], dim=1) * gain
            out[name] = q.reshape(heads * (dn + new_rope), w.shape[1])
    cfg = dict(cfg)
    theta = float(rope.get("rope_theta", cfg.get("rope_theta"))) ** (new_rope / dr)
    if "rope_parameters" in cfg:
        cfg["rope_parameters"] = {**rope, "rope_theta": theta}
    if "rope_theta" in cfg:
        cfg["rope_theta"] = theta
    cfg["qk_rope_head_dim"] = new_rope
    if "head_dim" in cfg:  # transformers' DeepseekV3Config: the RoPE head (the rotary's dim)
        cfg["head_dim"] = new_rope
    if "qk_head_dim" in cfg:
        cfg["qk_head_dim"] = dn + new_rope
    return out, cfg


def pad_mla(args) -> None:
    """Copy a DeepseekV3 export with its latent padded (:func:`pad_mla_state_dict`) and, with
    ``--untie``, an explicit ``lm_head.weight`` (vLLM's DeepseekV2/V3 model never ties it)."""
    import shutil

    from safetensors.torch import load_file, save_file

    cfg = json.loads((args.src / "config.json").read_text())
    sd = load_file(str(args.src / "model.safetensors"))
    if args.pad_rope:  # first: the k_pe rows stay the last rows of kv_a_proj_with_mqa
        sd, cfg = pad_mla_rope_state_dict(sd, cfg, args.pad_rope)
    sd = pad_mla_state_dict(sd, cfg["kv_lora_rank"], args.pad_rank)
    cfg["kv_lora_rank"] = args.pad_rank
    if args.untie:
        sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"].clone())
        cfg["tie_word_embeddings"] = False
    args.out.mkdir(parents=True, exist_ok=True)
    for f in args.src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy2(f, args.out / f.name)
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(
        {k: v.contiguous() for k, v in sd.items()},
        str(args.out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    print(
        f"wrote {args.out}: kv_lora_rank {args.pad_rank}, qk_rope_head_dim "
        f"{cfg['qk_rope_head_dim']}, tie_word_embeddings "
        f"{cfg['tie_word_embeddings']}"
    )
    if args.check:  # transformers: the padded model's logits against the source export's
        import torch
        from transformers import AutoModelForCausalLM

        ids = torch.tensor([[1, 504, 3575, 282, 4649, 314, 12615, 36411, 418, 253]])
        with torch.no_grad():
            a = AutoModelForCausalLM.from_pretrained(str(args.src), dtype=torch.float32)(ids)
            b = AutoModelForCausalLM.from_pretrained(str(args.out), dtype=torch.float32)(ids)
        diff = float((a.logits - b.logits).abs().max())
        print(f"transformers: max |logit(padded) - logit(source)| = {diff:.3g}")


def _greedy_hf(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy decode ``n`` tokens with transformers' model and cache; (tokens, top1-top2 gaps)."""
    import torch
    from transformers import DynamicCache

    # transformers >= 5.2x names the cache argument ``cache``; older ones ``past_key_values``.
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache()
    x = torch.tensor([ids])
    toks: list[int] = []
    gaps: list[float] = []
    pos = 0
    for _ in range(n):
        pos_ids = torch.arange(pos, pos + x.shape[1])[None]
        out = model(
            input_ids=x, position_ids=pos_ids, use_cache=True, logits_to_keep=1, **{key: cache}
        )
        pos += x.shape[1]
        logits = out.logits[0, -1].float()
        top = torch.topk(logits, 2)
        # argmax (the lowest id among tied maxima), as generate's greedy search and vLLM pick;
        # topk's order among ties is unspecified, which bfloat16 logits (ties are common) expose.
        toks.append(int(logits.argmax()))
        gaps.append(float(top.values[0] - top.values[1]))
        x = torch.tensor([[toks[-1]]])
    return toks, gaps


def run_reference(args) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=dtype).eval()
    recs = _read_jsonl(args.prompts)
    t0 = time.time()
    with args.out.open("w") as f, torch.no_grad():
        for r in recs:
            toks, gaps = _greedy_hf(model, r["prompt_token_ids"], args.max_new_tokens)
            f.write(json.dumps({"id": r["id"], "tokens": toks, "gaps": gaps}) + "\n")
    print(
        f"transformers {transformers.__version__} {args.dtype}: {len(recs)} prompts x "
        f"{args.max_new_tokens} tokens in {time.time() - t0:.0f}s -> {args.out}"
    )


# ------------------------------------------------------------------------------ vLLM side
def preflight(config: dict, weight_names: set[str], custom_ops: str | None = None) -> list[str]:
    """What vLLM 0.32's CPU build will do wrong or refuse with an export, from its files alone.

    Args:
        config: the export's ``config.json``.
        weight_names: the tensor names in its safetensors files.
        custom_ops: the ``--custom-ops`` the run passes to vLLM (None: vLLM's default).

    Returns:
        One sentence per problem (empty: none known). Found by running the exports here:
        vLLM's ``DeepseekV2ForCausalLM`` never ties ``lm_head`` to the embedding and its loader
        exempts unquantized modules from the missing-weight check, so a tied DeepseekV3 export
        without ``lm_head.weight`` loads silently with an all-zero head (every logit equal,
        token 0 forever); its CPU MLA decode kernel is compiled for
        ``kv_lora_rank + qk_rope_head_dim = 576`` only; its CPU ``rotary_embedding`` kernel
        rotates ``[tokens, heads, dim]`` inputs wrongly (even at position 0; ``[tokens,
        heads * dim]`` ones, what Llama passes, are right), and DeepSeek's MLA passes the 3-D
        ``q[..., qk_nope_head_dim:]`` and ``k_pe``.
    """
    problems = []
    if config.get("model_type") in ("deepseek_v2", "deepseek_v3"):
        if config.get("tie_word_embeddings") and "lm_head.weight" not in weight_names:
            problems.append(
                "tie_word_embeddings=true without lm_head.weight: vLLM's DeepseekV2/V3 model "
                "never ties the head and loads it uninitialized (zeros), silently; write "
                "lm_head.weight (pad-mla --untie)"
            )
        if "-rotary_embedding" not in (custom_ops or ""):
            problems.append(
                "vLLM's CPU rotary_embedding kernel is wrong on MLA's [tokens, heads, dim] q/k "
                "(0/20 greedy sequences matched transformers); pass "
                "--custom-ops=all,-rotary_embedding (its PyTorch path: 20/20)"
            )
        head = config.get("kv_lora_rank", 0) + config.get("qk_rope_head_dim", 0)
        if head != 576:
            problems.append(
                f"kv_lora_rank + qk_rope_head_dim = {head}: vLLM's CPU MLA backend supports 576 "
                "only (512 + 64; its GPU MLA backends 320, 512 or 576); pad the latent "
                "(pad-mla --pad-rank) and use qk_rope_head_dim=64"
            )
    return problems


def _weight_names(model_dir: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            names |= set(st.keys())
    return names


def run_vllm(args) -> None:
    """Greedy generation in vLLM (CPU) from the prompts' token ids; also re-tokenizes each
    prompt with vLLM's tokenizer (``tokenization_match``)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    # No core pinning (a shared machine); --threads OpenMP threads in the engine's worker.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import vllm
    from vllm import LLM, SamplingParams

    config = json.loads((args.model / "config.json").read_text())
    for problem in preflight(config, _weight_names(args.model), args.custom_ops):
        print(f"WARNING {args.model}: {problem}", flush=True)
    recs = _read_jsonl(args.prompts)
    max_len = max(len(r["prompt_token_ids"]) for r in recs) + args.max_new_tokens
    t0 = time.time()
    extra = {}
    if args.custom_ops:  # "all,-rotary_embedding" -> ["all", "-rotary_embedding"]
        extra["compilation_config"] = {"custom_ops": args.custom_ops.split(",")}
    llm = LLM(
        model=str(args.model),
        tokenizer=str(args.tokenizer or args.model),
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=max(max_len, 256),
        max_num_seqs=args.max_num_seqs,
        seed=0,
        trust_remote_code=False,
        **extra,
    )
    load_s = time.time() - t0
    params = SamplingParams(
        temperature=0.0, max_tokens=args.max_new_tokens, ignore_eos=True, logprobs=2
    )
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in recs]
    t0 = time.time()
    outs = llm.generate(prompts, params)
    gen_s = time.time() - t0
    tok = llm.get_tokenizer()
    with args.out.open("w") as f:
        for r, o in zip(recs, outs, strict=True):
            c = o.outputs[0]
            gaps = [_logprob_gap(step) for step in (c.logprobs or [])]
            f.write(
                json.dumps(
                    {
                        "id": r["id"],
                        "tokens": list(c.token_ids),
                        "gaps": gaps,
                        "tokenization_match": _vllm_ids(tok, r) == r["prompt_token_ids"],
                        "text": c.text,
                    }
                )
                + "\n"
            )
    print(
        f"vllm {vllm.__version__} {args.dtype}: loaded in {load_s:.0f}s, {len(recs)} prompts "
        f"x {args.max_new_tokens} tokens in {gen_s:.0f}s -> {args.out}"
    )


def _logprob_gap(step: dict) -> float:
    """Top-1 minus top-2 log-probability of one step's ``{token: Logprob}`` (the logit gap)."""
    vals = sorted((lp.logprob for lp in step.values()), reverse=True)
    return float(vals[0] - vals[1]) if len(vals) > 1 else float("nan")


def _vllm_ids(tok, r: dict) -> list[int]:
    """The prompt's ids through vLLM's tokenizer (and chat template) from its text alone."""
    if r["chat"]:
        return chat_ids(tok, r["text"])
    if r["kind"] == "recall":  # framed as the evaluation frames it: context and question apart
        ctx, q = r["text"].rsplit("What is the value of", 1)
        ids = tok.encode(ctx, add_special_tokens=False)
        ids += tok.encode("What is the value of" + q, add_special_tokens=False)
    else:
        ids = tok.encode(r["text"], add_special_tokens=False)
    return ([tok.bos_token_id] if r["add_bos"] else []) + ids


# ---------------------------------------------------------------------------- comparison
def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (a length difference counts at
    the shorter length); None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


COLUMNS = (
    "name",
    "prompt",
    "kind",
    "prompt_tokens",
    "new_tokens",
    "exact",
    "first_divergence",
    "matched_prefix",
    "ref_gap_at_div",
    "vllm_gap_at_div",
    "ref_token_at_div",
    "vllm_token_at_div",
    "vllm_tokenization_match",
    "min_ref_gap",
    "max_gap_diff",
)


def compare_records(name: str, prompts: list[dict], ref: list[dict], got: list[dict]) -> list[dict]:
    """One row per prompt plus a summary row (``prompt = "ALL"``).

    Args:
        prompts: the prompt records (``id``, ``kind``, ``prompt_token_ids``).
        ref, got: per-prompt ``{id, tokens, gaps}`` of the reference and of vLLM (any order;
            every prompt must be in both).

    Raises:
        ValueError: a prompt missing from ``ref`` or ``got`` (named).
    """
    by_ref = {r["id"]: r for r in ref}
    by_got = {r["id"]: r for r in got}
    rows = []
    for p in prompts:
        for side, table in (("reference", by_ref), ("vllm", by_got)):
            if p["id"] not in table:
                raise ValueError(f"prompt {p['id']!r} is missing from the {side} results")
        a, b = by_ref[p["id"]], by_got[p["id"]]
        div = first_divergence(a["tokens"], b["tokens"])

        def at(seq: list, i: int | None) -> object:
            return seq[i] if i is not None and i < len(seq) else ""

        rows.append(
            {
                "name": name,
                "prompt": p["id"],
                "kind": p["kind"],
                "prompt_tokens": len(p["prompt_token_ids"]),
                "new_tokens": len(a["tokens"]),
                "exact": int(div is None),
                "first_divergence": "" if div is None else div,
                "matched_prefix": len(a["tokens"]) if div is None else div,
                "ref_gap_at_div": _fmt(at(a["gaps"], div)),
                "vllm_gap_at_div": _fmt(at(b["gaps"], div)),
                "ref_token_at_div": at(a["tokens"], div),
                "vllm_token_at_div": at(b["tokens"], div),
                "vllm_tokenization_match": _fmt(b.get("tokenization_match", "")),
                "min_ref_gap": _fmt(min(a["gaps"]) if a["gaps"] else ""),
                "max_gap_diff": _fmt(_max_gap_diff(a["gaps"], b["gaps"], div)),
            }
        )
    n = len(rows)
    matched = sum(r["matched_prefix"] for r in rows)
    generated = sum(r["new_tokens"] for r in rows)
    divs = [r["first_divergence"] for r in rows if r["first_divergence"] != ""]
    tok_match = [r["vllm_tokenization_match"] for r in rows if r["vllm_tokenization_match"] != ""]
    rows.append(
        {
            "name": name,
            "prompt": "ALL",
            "kind": f"{n} prompts",
            "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "new_tokens": sum(r["new_tokens"] for r in rows),
            "exact": f"{sum(r['exact'] for r in rows) / n:.4f}",
            "first_divergence": f"min {min(divs)}" if divs else "",
            "matched_prefix": f"{matched / max(1, generated):.4f}",
            "ref_gap_at_div": "",
            "vllm_gap_at_div": "",
            "ref_token_at_div": "",
            "vllm_token_at_div": "",
            "vllm_tokenization_match": f"{sum(x == '1' for x in tok_match)}/{len(tok_match)}",
            "min_ref_gap": "",
            "max_gap_diff": _fmt(max((float(r["max_gap_diff"]) for r in rows), default="")),
        }
    )
    return rows


def _max_gap_diff(a: list[float], b: list[float], div: int | None) -> float | str:
    """Largest |reference gap - vLLM gap| over the steps both decoded from the same context
    (up to and including the first divergence): how far the two engines' logits drift apart."""
    n = min(len(a), len(b)) if div is None else min(div + 1, len(a), len(b))
    diffs = [abs(x - y) for x, y in zip(a[:n], b[:n]) if x == x and y == y]  # NaN-free
    return max(diffs) if diffs else ""


def _fmt(v: object) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def run_compare(args) -> None:
    rows = compare_records(
        args.name, _read_jsonl(args.prompts), _read_jsonl(args.reference), _read_jsonl(args.vllm)
    )
    new = not args.out.exists()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            w.writeheader()
        w.writerows(rows)
    s = rows[-1]
    print(
        f"{args.name}: exact {s['exact']} of {s['kind']}, matched-prefix fraction "
        f"{s['matched_prefix']}, first divergence {s['first_divergence'] or 'none'}, "
        f"vLLM tokenization {s['vllm_tokenization_match']}"
    )
    for r in rows[:-1]:
        if not r["exact"]:
            print(
                f"  {r['prompt']}: diverges at {r['first_divergence']} (ref gap "
                f"{r['ref_gap_at_div']}, vllm gap {r['vllm_gap_at_div']}; tokens "
                f"{r['ref_token_at_div']} vs {r['vllm_token_at_div']})"
            )


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prompts", help="write the tokenized prompt set (project venv)")
    a.add_argument("--tokenizer", type=Path, required=True, help="export or tokenizer dir")
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--recall", type=int, default=10, help="recall prompts (default 10)")
    e = sub.add_parser(
        "export-mla", help="convert SmolLM2 to MLA, export DeepseekV3 (project venv)"
    )
    e.add_argument("--source", type=Path, required=True, help="the GQA HF checkpoint dir")
    e.add_argument("--out", type=Path, required=True)
    e.add_argument(
        "--saved",
        default=None,
        help="STEM of a saved healed MLA model (STEM.safetensors + STEM.json, "
        "experiments/smollm2_mla/smollm2_mla.py --save-dir) instead of converting",
    )
    e.add_argument("--kv-lora-rank", type=int, default=128)
    e.add_argument("--rope-dim", type=int, default=32)
    e.add_argument("--calib-seqs", type=int, default=8)
    e.add_argument("--calib-len", type=int, default=256)
    e.add_argument("--threads", type=int, default=2)
    d = sub.add_parser("pad-mla", help="pad a DeepseekV3 export's latent for vLLM's CPU kernel")
    d.add_argument("--src", type=Path, required=True)
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--pad-rank", type=int, default=512, help="new kv_lora_rank (default 512)")
    d.add_argument(
        "--pad-rope",
        type=int,
        default=None,
        help="new qk_rope_head_dim (e.g. 64; default: unchanged)",
    )
    d.add_argument("--untie", action="store_true", help="write lm_head.weight explicitly")
    d.add_argument("--check", action="store_true", help="compare logits in transformers")
    for name, helptext in (
        ("reference", "transformers greedy (project venv)"),
        ("vllm", "vLLM greedy on the CPU (.venv-vllm)"),
    ):
        b = sub.add_parser(name, help=helptext)
        b.add_argument("--model", type=Path, required=True)
        b.add_argument("--prompts", type=Path, required=True)
        b.add_argument("--out", type=Path, required=True)
        b.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
        b.add_argument("--max-new-tokens", type=int, default=32)
        b.add_argument("--threads", type=int, default=2)
        if name == "vllm":
            b.add_argument("--tokenizer", type=Path, default=None, help="default: --model")
            b.add_argument("--max-num-seqs", type=int, default=20)
            b.add_argument(
                "--custom-ops",
                default=None,
                help="vLLM compilation_config.custom_ops, comma-separated, e.g. "
                "all,-rotary_embedding (vLLM "
                "0.32's CPU rotary kernel is wrong on the [T, heads, dim] q/k DeepSeek's MLA "
                "passes; -rotary_embedding uses its PyTorch path)",
            )
    c = sub.add_parser("compare", help="token-by-token comparison -> CSV (either venv)")
    c.add_argument("--name", required=True, help="row label, e.g. q4_llama_fp32")
    c.add_argument("--prompts", type=Path, required=True)
    c.add_argument("--reference", type=Path, required=True)
    c.add_argument("--vllm", type=Path, required=True)
    c.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if getattr(args, "max_new_tokens", 1) < 1:
        p.error(f"--max-new-tokens={args.max_new_tokens} is out of range; allowed [1, inf)")
    if args.cmd == "prompts":
        write_prompts(args)
    elif args.cmd == "export-mla":
        export_mla(args)
    elif args.cmd == "pad-mla":
        pad_mla(args)
    elif args.cmd == "reference":
        run_reference(args)
    elif args.cmd == "vllm":
        run_vllm(args)
    else:
        run_compare(args)


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    sys.exit(main())
