"""Training-free anchors at equal KV bytes: NVIDIA kvpress presses on the same weights and the
same prompts as our evaluation, alone (16-bit) and followed by int4/int8 storage of what they
keep, plain int4/int8 with no eviction, and a "no press" sanity row.

Two halves, two environments (kvpress pins transformers < 5.3; the project needs >= 5.8):

1. in the project's venv, write held-out prompts (fields ``id, task, context, question,
   answer``; seeds >= 1,000,000 only) and our own harness's predictions on them::

       python experiments/kvpress/kvpress_baseline.py prompts --out runs/kvpress/recall8.jsonl \\
           --num 200 --pairs 8 --seed 1000003
       python experiments/kvpress/kvpress_baseline.py reference --prompts runs/kvpress/recall8.jsonl \\
           --model DIR --out runs/kvpress/base_reference.jsonl

2. in ``.venv-kvpress`` (``experiments/kvpress/kvpress_env.sh``), the grid of rows::

       .venv-kvpress/bin/python experiments/kvpress/kvpress_baseline.py run \\
           --prompts runs/kvpress/recall8.jsonl --model DIR --name base \\
           --reference runs/kvpress/base_reference.jsonl --out-dir experiments/smollm2_evidence

   Rows go to ``<out-dir>/kvpress_<name>.csv`` (appended), one JSONL of per-prompt predictions
   per row beside it: ``kvpress_<name>_<press>_<setting>.jsonl`` (``id, task, answer,
   prediction, correct``), ``setting`` = storage and target, e.g. ``int4_8x``; ``16bit`` alone
   is the no-press row, ``int4`` alone plain int4.

Each prompt, exactly like :func:`unicache_train.eval.recall.run_recall` one prompt at a time
(prompts whose context, question and answer have the same token lengths run as one batch, with
no padding, so a press scores exactly the tokens it scores alone): the context (``[bos] + "key: value" lines``) is prefilled with the press active (kvpress
compresses each layer's cache during the prefill forward, so the press never sees the
question), the kept entries are fake-quantized in place (storage ``int4``/``int8``), the
question is fed on the compressed cache at its true positions and the answer decoded greedily
(``len(tokens(" " + answer)) + 1`` tokens, first line, stripped, exact match).

Byte accounting, ours (:func:`unicache_train.seam.stored_kv_bytes` with one fp16 scale per
(token, KV head) vector, ``granularity="token_head"``; read there, re-stated here because this
half runs without our package): per kept token, layer and KV head, K and V each store
``D * bits / 8`` bytes + a 2-byte scale (16-bit: ``2 * D`` bytes, no scale); the uncompressed
16-bit cache stores ``2 * D`` bytes each for every context token. With ``D = 64``: 256 bytes
uncompressed, 68 at int4, 132 at int8. A press that keeps a fraction ``f`` of the tokens reaches
``256 / (f * stored)``, so a target ``R`` needs ``f = 256 / (R * stored)``, i.e. kvpress's
``compression_ratio = 1 - f`` (int4: 4x -> 0.059, 8x -> 0.529; int8: 4x -> 0.515, 8x -> 0.758;
16-bit: 1 - 1/R). The reported ``kv_reduction`` is measured on the caches the run produced (the
tokens each layer really kept, summed over prompts), not the nominal one.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

EVAL_SEED_FLOOR = 1_000_000  # unicache_train.data.recall_mix.EVAL_SEED_FLOOR
SCALE_BYTES = 2  # one fp16 scale per (token, KV head) vector
PRESSES = (
    "StreamingLLM",
    "SnapKV",
    "Knorm",
    "ExpectedAttention",
    "TOVA",
    "KeyDiff",
    "KVzip",
    "KVzipLayerwise",
    "KVzipHeadShared",
)
# Evict by head-wise masks, batch size 1 (kvpress's KVzipPress). KVzipLayerwise is KVzipPress with
# layerwise=True: the same scores, the same fraction evicted in every layer (head-wise within the
# layer) instead of one budget shared by all layers and heads: the ablation that tells whether the
# cross-layer budget is what keeps the needle. KVzipHeadShared keeps KVzip's budget over all
# layers but one token set per layer, shared by its KV heads (each token's score the mean over the
# layer's heads, :func:`share_over_heads`): our selections' structure with KVzip's scores, the
# ablation that tells what per-head selection is worth.
MASKED_PRESSES = ("KVzip", "KVzipLayerwise", "KVzipHeadShared")
CSV_COLUMNS = (
    "model",
    "weights",
    "weights_sha256",
    "method",
    "press",
    "storage",
    "target_reduction",
    "compression_ratio",
    "kv_reduction",
    "kept_fraction",
    "task",
    "hits",
    "n",
    "recall",
    "recall_se",
    "reference_hits",
    "reference_disagree",
    "seconds",
    "s_per_prompt",
    "predictions",
    "threads",
    "transformers",
    "kvpress",
)


# ------------------------------------------------------------------------------ bytes and storage
def vector_bytes(bits: int, head_dim: int) -> int:
    """Stored bytes of one K (or V) vector of ``head_dim`` values: 16-bit floats, or packed
    ``bits``-bit integers plus one fp16 scale."""
    if bits == 16:
        return 2 * head_dim
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is out of range; allowed 4, 8, 16")
    return head_dim * bits // 8 + SCALE_BYTES


def press_ratio(target: float, bits: int, head_dim: int) -> float:
    """kvpress ``compression_ratio`` (share of context tokens evicted) that reaches ``target``
    times fewer KV bytes than the 16-bit cache when the kept tokens are stored at ``bits``."""
    kept = vector_bytes(16, head_dim) / (target * vector_bytes(bits, head_dim))
    if not 0.0 < kept <= 1.0:
        raise ValueError(
            f"target={target} at {bits} bits is out of reach: storage alone gives "
            f"{vector_bytes(16, head_dim) / vector_bytes(bits, head_dim):.3f}x"
        )
    return 1.0 - kept


def fake_quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric quantize-dequantize, one fp16 scale per vector (last axis), as
    :func:`unicache_train.compress.quantize.quantize_symmetric` with ``granularity="token_head"``:
    ``scale = fp16(max|x| / qmax)``, ``q = clamp(round(x / scale), -qmax, qmax)``.

    Args:
        x: [B, H, T, D].

    Returns:
        [B, H, T, D] in x's dtype: ``q * scale``.
    """
    qmax = 2 ** (bits - 1) - 1
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / qmax).clamp(max=65504.0).half().float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero vector: q = 0
    return (torch.round(xf / scale).clamp(-qmax, qmax) * scale).to(x.dtype)


# ------------------------------------------------------------------------------ the grid
@dataclass(frozen=True)
class Setting:
    """One row: a press (None: no eviction) at a target reduction (None: whatever storage
    alone gives), with the kept entries stored at ``bits``."""

    press: str | None
    bits: int
    target: float | None

    @property
    def storage(self) -> str:
        return "16bit" if self.bits == 16 else f"int{self.bits}"

    @property
    def name(self) -> str:
        """``<press>_<storage>[_<target>x]``: ``none_16bit`` is the no-press row."""
        tail = f"_{self.target:g}x" if self.target is not None else ""
        return f"{self.press or 'none'}_{self.storage}{tail}"

    @property
    def method(self) -> str:
        """Row label of the study table: ``kvpress:SnapKV+int4``, ``int4`` (plain), ``none``."""
        if self.press is None:
            return "none" if self.bits == 16 else self.storage
        return f"kvpress:{self.press}" + ("" if self.bits == 16 else f"+{self.storage}")

    def ratio(self, head_dim: int) -> float:
        return 0.0 if self.target is None else press_ratio(self.target, self.bits, head_dim)


def build_grid(
    presses: list[str], reductions: list[float], storages: list[int], plain: bool
) -> list[Setting]:
    """The no-press row first, then plain quantization, then every press x storage x target."""
    grid = [Setting(None, 16, None)]
    if plain:
        grid += [Setting(None, b, None) for b in storages if b != 16]
    grid += [Setting(p, b, r) for r in reductions for b in storages for p in presses]
    return grid


# ------------------------------------------------------------------------------ prompts
#: Fields of a text prompt (recall: exact match of one answer) and of a token-id prompt (the
#: long-context study's ``study.py kvpress-prompts``: every answer contained, case-insensitive).
TEXT_FIELDS = {"id", "task", "context", "question", "answer"}
ID_FIELDS = {"id", "task", "context_ids", "question_ids", "answers", "max_new"}


def read_prompts(path: Path) -> list[dict]:
    """Prompts of one kind: text (``TEXT_FIELDS``) or token ids (``ID_FIELDS``)."""
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not recs:
        raise ValueError(f"{path}: no prompts")
    fields = ID_FIELDS if "context_ids" in recs[0] else TEXT_FIELDS
    for r in recs:
        missing = fields - set(r)
        if missing:
            raise ValueError(f"{path}: record {r.get('id', '?')} lacks {sorted(missing)}")
    if len({r["id"] for r in recs}) != len(recs):
        raise ValueError(f"{path}: prompt ids are not unique")
    return recs


def write_prompts(args) -> None:
    """Held-out recall prompts (project venv: the records of ``unicache_train.eval``)."""
    from unicache_train.eval import RecallTask, recall_records

    if args.seed < EVAL_SEED_FLOOR:
        raise SystemExit(f"--seed={args.seed} is out of range; allowed >= {EVAL_SEED_FLOOR}")
    task = RecallTask(pairs=args.pairs, distractors=args.distractors)
    recs = recall_records(task, args.num, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for i, r in enumerate(recs):
            row = {"id": f"{task.name}/{args.seed}/{i}", "task": task.name, **r, "seed": args.seed}
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(recs)} prompts of {task.name} (seed {args.seed}) to {args.out}")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")  # atomic: a killed run leaves no half file
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


# ------------------------------------------------------------------------------ our harness
def run_reference(args) -> None:
    """Our own evaluation (project venv) on the same prompts, one prompt at a time, nothing
    compressed (or plain ``--quantize int4|int8`` by our UniCache quantizer alone): the
    predictions the no-press row must reproduce."""
    from unicache_train.checkpoint.hf import import_hf
    from unicache_train.data.tokenizer import load_tokenizer
    from unicache_train.eval.recall import run_recall
    from unicache_train.seam import IdentityCompressor

    torch.set_num_threads(args.threads)
    model, _ = import_hf(args.model)
    model = model.float().eval()
    tok = load_tokenizer(str(args.tokenizer or args.model))
    if args.quantize:
        from unicache_train.compress import UniCacheCompressor
        from unicache_train.compress.config import UniCacheConfig
        from unicache_train.eval.budget import text_unicache

        d = text_unicache(0.0, 0, args.quantize).to_dict()
        d["head_merge"]["enabled"] = False
        compressor = UniCacheCompressor(UniCacheConfig.from_dict(d))
    else:
        compressor = IdentityCompressor()
    recs = read_prompts(args.prompts)
    t0 = time.time()
    res = run_recall(model, tok, recs, compressor, batch_size=1)
    rows = [
        {
            "id": r["id"],
            "task": r["task"],
            "answer": r["answer"],
            "prediction": p,
            "correct": p == r["answer"],
        }
        for r, p in zip(recs, res.predictions)
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out, rows)
    print(
        f"ours ({args.quantize or 'uncompressed'}) on {args.model}: {res.hits}/{res.n} "
        f"kv_reduction {res.kv_reduction:.3f}x ({time.time() - t0:.0f}s) -> {args.out}"
    )


# ------------------------------------------------------------------------------ kvpress half
def weights_sha256(model_dir: Path) -> str:
    """sha256 over the directory's ``*.safetensors`` files (sorted by name)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors")
    h = hashlib.sha256()
    for p in files:
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


def share_over_heads(scores: torch.Tensor) -> torch.Tensor:
    """KVzip's scores ``[layers, B, H_kv, T]`` with every KV head of a layer given the mean over
    the layer's heads: a bottom-k over (head, token) then evicts whole tokens (all heads of a
    layer at once; a tie split at the budget's edge leaves one token partly kept, counted as
    such by :meth:`PressRunner.kept_entries`)."""
    return scores.mean(dim=2, keepdim=True).expand_as(scores).contiguous()


def _head_shared_kvzip(kvpress):
    """KVzipPress whose scores are shared by the KV heads of a layer before its budget over all
    layers is applied (kvpress imported by the caller: this module also loads without it)."""

    class KVzipHeadSharedPress(kvpress.KVzipPress):
        def compress_post(self, model):
            if self.compression_ratio > 0:
                self.score_val = share_over_heads(self.score_val)
            return super().compress_post(model)

    return KVzipHeadSharedPress


class PressRunner:
    """One model under kvpress: prefill (press active), store, decode, count bytes."""

    def __init__(self, model_dir: Path, tokenizer_dir: Path, threads: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        torch.set_num_threads(threads)
        hf_logging.disable_progress_bar()
        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        cfg = self.model.config
        self.layers = cfg.num_hidden_layers
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def make_press(self, s: Setting):
        import kvpress

        if s.press in MASKED_PRESSES:
            self._kvzip_tokenizer()
        if s.press == "KVzipLayerwise":
            return kvpress.KVzipPress(compression_ratio=s.ratio(self.head_dim), layerwise=True)
        if s.press == "KVzipHeadShared":
            return _head_shared_kvzip(kvpress)(compression_ratio=s.ratio(self.head_dim))
        return getattr(kvpress, f"{s.press}Press")(compression_ratio=s.ratio(self.head_dim))

    def _kvzip_tokenizer(self) -> None:
        """KVzip builds its repeat prompt from the tokenizer at ``model.config.name_or_path``
        and, when that has a chat template, treats the template's prefix length as a prompt
        prefix to skip. Our prompts are raw text (no chat template: ``[bos] + context``), so
        KVzip gets a copy of the tokenizer without the template: no prefix, ``"\n"`` before
        the repeated context (kvpress's own choice for template-less models)."""
        import shutil
        import tempfile

        if getattr(self, "_plain_tok_dir", None):
            return
        out = Path(tempfile.mkdtemp(prefix="kvzip_tok_"))
        for f in Path(self.tok.name_or_path).iterdir():
            if f.name in ("tokenizer.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
                shutil.copy(f, out / f.name)
            elif f.name == "tokenizer_config.json":
                cfg = json.loads(f.read_text())
                cfg.pop("chat_template", None)
                (out / f.name).write_text(json.dumps(cfg))
        self._plain_tok_dir = out
        self.model.config.name_or_path = str(out)

    def kept_entries(self, cache) -> int:
        """K (or V) vectors one prompt's cache keeps, summed over layers and KV heads: the
        entries a press evicted (tokens cut from the cache) and the ones it masks head-wise
        (kvpress's ``masked_key_indices``: KVzip, AdaKV) both count as gone."""
        kept = 0
        for i, layer in enumerate(cache.layers):
            if layer.keys.shape[0] != 1 and self._masked(i) is not None:
                raise ValueError("head-wise masked presses run one prompt at a time")
            kept += layer.keys.shape[1] * layer.keys.shape[-2]
            masked = self._masked(i)
            if masked is not None:
                kept -= int(masked[0].numel())
        return kept

    def _masked(self, layer_idx: int):
        return getattr(self.model.model.layers[layer_idx].self_attn, "masked_key_indices", None)

    def encode(self, rec: dict) -> tuple[list[int], list[int], int]:
        """(context ids ``[bos] + context``, question ids, answer tokens to decode); a token-id
        prompt gives them itself."""
        if "context_ids" in rec:
            return list(rec["context_ids"]), list(rec["question_ids"]), int(rec["max_new"])
        tok = self.tok
        ctx = [tok.bos_token_id] + tok.encode(rec["context"], add_special_tokens=False)
        q = tok.encode(rec["question"], add_special_tokens=False)
        return ctx, q, len(tok.encode(" " + rec["answer"], add_special_tokens=False)) + 1

    @torch.no_grad()
    def answer(
        self,
        ctx: list[list[int]],
        q: list[list[int]],
        n_ans: int,
        press,
        bits: int,
        raw: bool = False,
    ):
        """Predictions of a batch of prompts whose contexts, questions and answers have the same
        token lengths (no padding: a press scores exactly what it scores one prompt at a time),
        and the K vectors each prompt's cache kept, summed over layers and KV heads.

        ``raw``: the whole decoded continuation (token-id prompts, scored by containment);
        else its first line, stripped (recall, scored by exact match).

        Returns:
            (list of B predictions, kept entries per prompt).
        """
        from transformers import DynamicCache

        model = self.model
        ids, qs = torch.tensor(ctx), torch.tensor(q)  # [B, P], [B, Q]
        B, P, Q = ids.shape[0], ids.shape[1], qs.shape[1]
        cache = DynamicCache()
        if press is None:
            model(input_ids=ids, past_key_values=cache)
        else:
            with press(model):
                model(input_ids=ids, past_key_values=cache)
        kept = self.kept_entries(cache)
        for layer in cache.layers:
            if bits != 16:  # NOTE: after the press: storage of what it kept, as our pipeline
                layer.keys = fake_quantize(layer.keys, bits)
                layer.values = fake_quantize(layer.values, bits)
        pos = torch.arange(P, P + Q)[None].expand(B, Q)
        out = model(input_ids=qs, past_key_values=cache, position_ids=pos)
        nxt = out.logits[:, -1].argmax(-1)  # [B]
        gen = [nxt]
        for i in range(n_ans - 1):
            out = model(
                input_ids=nxt[:, None],
                past_key_values=cache,
                position_ids=torch.full((B, 1), P + Q + i),
            )
            nxt = out.logits[:, -1].argmax(-1)
            gen.append(nxt)
        toks = torch.stack(gen, 1).tolist()  # [B, n_ans]
        if raw:
            return [self.tok.decode(t, skip_special_tokens=True) for t in toks], kept
        preds = [
            self.tok.decode(t, skip_special_tokens=True).lstrip(" ").split("\n")[0].strip()
            for t in toks
        ]
        return preds, kept

    def bytes_of(self, ctx_tokens: int, kept: int, bits: int) -> tuple[int, int]:
        """(uncompressed 16-bit bytes, stored bytes) of one prompt's context cache (K and V);
        ``kept``: the K vectors kept, over layers and KV heads (:meth:`kept_entries`)."""
        base = 2 * self.layers * ctx_tokens * self.kv_heads * vector_bytes(16, self.head_dim)
        return base, 2 * kept * vector_bytes(bits, self.head_dim)


def contains_all(prediction: str, answers: list[str]) -> bool:
    """Every expected value occurs in the prediction, case-insensitive (RULER's
    ``string_match_all``; :func:`unicache_train.data.long_context.score_prediction`, restated:
    this half runs without our package)."""
    low = prediction.lower()
    return all(str(a).lower() in low for a in answers)


def study_setting(s: Setting) -> str:
    """The long-context study's name of a row: ``kvpress_<Press>_<storage>@<R>``,
    ``kvpress_none`` (the no-press row), ``kvpress_int4`` (plain)."""
    if s.press is None:
        return "kvpress_none" if s.bits == 16 else f"kvpress_{s.storage}"
    return f"kvpress_{s.press}_{s.storage}@{s.target:g}"


def length_batches(enc: list[tuple[list[int], list[int], int]], size: int) -> list[list[int]]:
    """Prompt indices grouped by (context, question, answer) token lengths, at most ``size``
    a batch, in order of first appearance."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for i, (ctx, q, n_ans) in enumerate(enc):
        groups.setdefault((len(ctx), len(q), n_ans), []).append(i)
    return [g[s : s + size] for g in groups.values() for s in range(0, len(g), size)]


def _progress(batches: list[list[int]], desc: str):
    """A progress bar over the prompts of one row (tqdm, which transformers brings), on stderr."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        yield from batches
        return
    with tqdm(total=sum(map(len, batches)), desc=desc, unit="prompt", leave=False) as bar:
        for idx in batches:
            yield idx
            bar.update(len(idx))


def _jsonl_name(model: str, s: Setting, ids_kind: bool) -> str:
    """Per-prompt file of a row: ``kvpress_<model>_<setting>.jsonl``; for token-id prompts the
    long-context study's ``<model>_<study setting>.jsonl`` (its ``raw/`` layout)."""
    return f"{model}_{study_setting(s)}.jsonl" if ids_kind else f"kvpress_{model}_{s.name}.jsonl"


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


def run_presses(args) -> None:
    recs = read_prompts(args.prompts)
    ids_kind = "context_ids" in recs[0]
    tasks = sorted({r["task"] for r in recs})
    if len(tasks) != 1 and not ids_kind:
        raise SystemExit(f"{args.prompts}: one task per file, got {tasks}")
    reference = None
    if args.reference:
        reference = {r["id"]: r for r in map(json.loads, args.reference.read_text().splitlines())}
        if set(reference) != {r["id"] for r in recs}:
            raise SystemExit(f"{args.reference}: not the same prompt ids as {args.prompts}")
    sha = weights_sha256(args.model)
    runner = PressRunner(args.model, args.tokenizer or args.model, args.threads)
    enc = [runner.encode(r) for r in recs]
    batches = length_batches(enc, args.batch_size)
    grid = build_grid(args.presses, args.reductions, args.storage, not args.no_plain)
    if args.only:  # these rows, in this order (the most needed first on a busy machine)
        by_name = {s.name: s for s in grid}
        unknown = sorted(set(args.only) - set(by_name))
        if unknown:
            raise SystemExit(f"--only: unknown setting(s) {unknown}; known: {sorted(by_name)}")
        grid = [by_name[n] for n in args.only]
    out_csv = args.out_dir / f"kvpress_{args.name}.csv"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    new = not out_csv.exists()
    if not new:  # a row already in the CSV (its predictions beside it) is not run again
        with out_csv.open(newline="") as f:
            done = {r["predictions"] for r in csv.DictReader(x for x in f if x[0] != "#")}
        skip = [s for s in grid if _jsonl_name(args.name, s, ids_kind) in done]
        if skip:
            print(f"{out_csv}: rows already there, skipped: {[s.name for s in skip]}")
        grid = [s for s in grid if s not in skip]
    failed = []
    with out_csv.open("a", newline="") as f:
        f.write(f"# command: {' '.join(sys.argv)}\n")  # every invocation that adds rows
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        if new:
            w.writeheader()
        for s in grid:
            press = None if s.press is None else runner.make_press(s)
            t0, base_b, stored_b, ctx_t, kept_t, rows = time.time(), 0, 0, 0, 0, {}
            # Head-wise masked presses (KVzip) score one prompt at a time.
            todo = [[i] for b in batches for i in b] if s.press in MASKED_PRESSES else batches
            for idx in _progress(todo, f"{args.name} {s.name}"):
                preds, kept = runner.answer(
                    [enc[i][0] for i in idx],
                    [enc[i][1] for i in idx],
                    enc[idx[0]][2],
                    press,
                    s.bits,
                    raw=ids_kind,
                )
                for i, pred in zip(idx, preds):
                    r, n_ctx = recs[i], len(enc[i][0])
                    b, st = runner.bytes_of(n_ctx, kept, s.bits)
                    base_b, stored_b = base_b + b, stored_b + st
                    ctx_t = ctx_t + n_ctx * runner.layers * runner.kv_heads
                    kept_t = kept_t + kept
                    if ids_kind:  # the long-context study's row (its table reads these)
                        rows[i] = {
                            "model": args.name,
                            "setting": study_setting(s),
                            "id": r["id"],
                            "task": r["task"],
                            "family": r.get("family"),
                            "question_index": 0,
                            "prediction": pred,
                            "answers": r["answers"],
                            "correct": contains_all(pred, r["answers"]),
                            "tokens": n_ctx - 1,
                            "kv_bytes": st,
                            "baseline_bytes": b,
                        }
                        continue
                    rows[i] = {
                        "id": r["id"],
                        "task": r["task"],
                        "answer": r["answer"],
                        "prediction": pred,
                        "correct": pred == r["answer"],
                    }
            rows = [rows[i] for i in range(len(recs))]
            secs = time.time() - t0
            jsonl = args.out_dir / _jsonl_name(args.name, s, ids_kind)
            write_jsonl(jsonl, rows)
            hits, n = sum(r["correct"] for r in rows), len(rows)
            ref_hits = ref_dis = ""
            if reference is not None and s.name == "none_16bit":
                ref_hits = sum(bool(reference[r["id"]]["correct"]) for r in rows)
                ref_dis = sum(reference[r["id"]]["prediction"] != r["prediction"] for r in rows)
                if abs(ref_hits - hits) > 1:
                    failed.append(f"no-press {hits}/{n} vs our harness {ref_hits}/{n}")
            acc = hits / n
            w.writerow(
                {
                    "model": args.name,
                    "weights": str(Path(args.model).resolve()),
                    "weights_sha256": sha,
                    "method": s.method,
                    "press": s.press or "none",
                    "storage": s.storage,
                    "target_reduction": s.target or "",
                    "compression_ratio": f"{s.ratio(runner.head_dim):.4f}",
                    "kv_reduction": f"{base_b / stored_b:.4f}",
                    "kept_fraction": f"{kept_t / ctx_t:.4f}",
                    "task": "+".join(tasks),
                    "hits": hits,
                    "n": n,
                    "recall": f"{acc:.4f}",
                    "recall_se": f"{math.sqrt(acc * (1 - acc) / n):.4f}",
                    "reference_hits": ref_hits,
                    "reference_disagree": ref_dis,
                    "seconds": f"{secs:.1f}",
                    "s_per_prompt": f"{secs / n:.3f}",
                    "predictions": jsonl.name,
                    "threads": args.threads,
                    "transformers": _version("transformers"),
                    "kvpress": _version("kvpress"),
                }
            )
            f.flush()
            print(
                f"{args.name} {s.name:<28} {base_b / stored_b:6.2f}x  {hits:3d}/{n} "
                f"({secs:.0f}s, {secs / n:.2f} s/prompt)"
                + (
                    f"  ours {ref_hits}/{n}, {ref_dis} predictions differ" if ref_hits != "" else ""
                ),
                flush=True,
            )
    if failed:
        raise SystemExit("sanity check failed: " + "; ".join(failed))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prompts", help="write held-out recall prompts (project venv)")
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--num", type=int, default=200)
    a.add_argument("--pairs", type=int, default=8)
    a.add_argument("--distractors", type=int, default=0)
    a.add_argument("--seed", type=int, default=1_000_003)
    c = sub.add_parser("reference", help="our own harness on the prompts (project venv)")
    c.add_argument("--prompts", type=Path, required=True)
    c.add_argument("--model", type=Path, required=True)
    c.add_argument("--tokenizer", type=Path, default=None)
    c.add_argument("--quantize", choices=("int4", "int8"), default=None)
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--threads", type=int, default=1)
    b = sub.add_parser("run", help="the grid of kvpress rows (kvpress venv)")
    b.add_argument("--prompts", type=Path, required=True)
    b.add_argument("--model", type=Path, required=True)
    b.add_argument("--name", required=True, help="model label in file names and rows, e.g. base")
    b.add_argument("--tokenizer", type=Path, default=None, help="default: --model")
    b.add_argument("--presses", nargs="+", default=["StreamingLLM", "SnapKV"], choices=PRESSES)
    b.add_argument("--reductions", nargs="+", type=float, default=[4.0, 8.0])
    b.add_argument("--storage", nargs="+", type=int, default=[16, 8, 4], choices=(16, 8, 4))
    b.add_argument("--no-plain", action="store_true", help="skip plain int4/int8 rows")
    b.add_argument("--only", nargs="*", default=None, help="only these settings, in this order")
    b.add_argument("--reference", type=Path, default=None, help="our predictions (reference)")
    b.add_argument("--out-dir", type=Path, required=True)
    b.add_argument("--threads", type=int, default=1)
    b.add_argument("--batch-size", type=int, default=16, help="prompts of equal lengths at once")
    args = p.parse_args()
    if args.cmd == "prompts":
        write_prompts(args)
    elif args.cmd == "reference":
        run_reference(args)
    else:
        if any(not r > 1 for r in args.reductions):
            p.error(f"--reductions={args.reductions} out of range; allowed (1, inf)")
        run_presses(args)


if __name__ == "__main__":
    main()
