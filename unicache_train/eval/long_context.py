"""Long-context evaluation under KV compression: one uncompressed prefill per context serves every
setting.

::

    contexts [B] ─► ONE prefill (causal attention; every layer's CompressionInput recorded)
                        │
                        ├─ setting 1: compressor(each layer's input) ─► CompressedKVCache ─► decode
                        ├─ setting 2: ...                                        the questions
                        └─ setting S                                             (batched)

The prefill of a context does not depend on the compressor (context queries attend causally to
the full context; the compressor only decides what the *later* tokens see), so the recorded
inputs are exactly what :func:`~unicache_train.model.generate.prefill_compressed` hands each
compressor: the caches built here equal its caches (tested, ``tests/test_long_context.py``), at
one prefill for all settings instead of one per setting.

Modes (the records are :func:`~unicache_train.data.long_context.long_context_records`'):

* ``"agnostic"`` (primary): the context is compressed before the question exists; the question
  is then decoded on the compressed cache and the answer generated greedily;
* ``"questions"``: every question of a record (``record["questions"]``) on the *same* compressed
  context, each from the state right after compression (the cached-document use);
* ``"aware"``: the question is part of the prefill (compressed with the context, so a scorer
  with an observation window sees it) and the answer is generated after it.

Decoding is batched: each row feeds its own question tokens, then its own generated tokens, one
token per step (questions of different lengths need no padding). A prediction is the decoded
continuation (``max_new`` tokens: the answers' length plus a margin), scored by
:func:`~unicache_train.data.long_context.score_prediction` (every expected value contained,
case-insensitive). Rows carry the stored and the uncompressed bytes of their own context.

Held-out perplexity under compression (:func:`continuation_nll`): the same shared prefill of a
window's first ``split`` tokens, each setting's compressed cache, then the window's remaining
tokens teacher-forced on it in one block; per window the summed NLL of every continuation token
(the first predicted from the prefill's last position, as in decoding). Equal to the in-loop
compressed forward's continuation NLL (``tests/test_long_context.py``).

Not supported (clear errors): cross-layer (xKV) and pre-RoPE compressors, sliding-window models.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from unicache_train.compress.composer import ComposedCompressor
from unicache_train.data.long_context import score_prediction
from unicache_train.model.compressed_cache import CompressedKVCache, StoredSegment
from unicache_train.seam import (
    CompressionInput,
    RecordedContext,
    RecordingCompressor,
    find_cross_layer,
    stored_kv_bytes,
    uncompressed_kv_bytes,
)

__all__ = [
    "MODES",
    "LongContextResult",
    "continuation_nll",
    "run_long_context",
    "sample_kv_bytes",
    "segments_for",
]

MODES = ("agnostic", "questions", "aware")

#: Tokens generated beyond the answers' own length.
ANSWER_MARGIN = 6


@dataclass
class LongContextResult:
    """One setting's per-prompt rows and totals.

    Attributes:
        rows: one dict per (record, question): ``id``, ``task``, ``family``, ``question_index``,
            ``prediction``, ``answers``, ``correct``, ``tokens``, ``kv_bytes``,
            ``baseline_bytes``.
        seconds: wall time of this setting's compression and decoding (the shared prefill is in
            :func:`run_long_context`'s ``timing``).
    """

    rows: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def n(self) -> int:
        return len(self.rows)

    @property
    def hits(self) -> int:
        return sum(bool(r["correct"]) for r in self.rows)

    @property
    def accuracy(self) -> float:
        return self.hits / self.n if self.n else float("nan")

    @property
    def kv_reduction(self) -> float:
        """Uncompressed 16-bit bytes / stored bytes over the distinct contexts."""
        seen: dict[str, tuple[int, int]] = {}
        for r in self.rows:
            seen[r["id"]] = (r["kv_bytes"], r["baseline_bytes"])
        kv = sum(v[0] for v in seen.values())
        return sum(v[1] for v in seen.values()) / kv if kv else float("nan")


# ------------------------------------------------------------------------------ segments
def _check(model, compressor: Any, name: str) -> None:
    cross = find_cross_layer(compressor)
    if cross is not None and not isinstance(cross, ComposedCompressor):
        # One budget over layers (schedule.global_budget) fits on the shared prefill's record;
        # xKV's low-rank segments cannot be split into the questions' rows.
        raise NotImplementedError(
            f"setting {name!r}: a cross-layer (xKV) compressor needs the decoder's two passes; "
            "evaluate it with unicache_train.eval.recall.run_recall"
        )
    if getattr(compressor, "pre_rope", False):
        raise NotImplementedError(
            f"setting {name!r}: a pre-RoPE compressor is not supported by the shared prefill "
            "(the recorded keys are post-RoPE)"
        )
    if model.config.has_sliding_layers:
        raise NotImplementedError(
            "run_long_context does not support sliding-window models (their windowed layers "
            "are not compressed at the seam)"
        )


def segments_for(
    inputs: Mapping[int, CompressionInput], compressor: Any
) -> dict[int, StoredSegment]:
    """Each recorded layer's input through ``compressor``, kept as a decoding cache stores it
    (what :func:`~unicache_train.model.generate.prefill_compressed` stores).

    A compressor with one budget over all layers (``schedule.global_budget``) first fits its
    layer rates on all of ``inputs``, as the decoder's recording pass would have it do."""
    fit = None
    cross = find_cross_layer(compressor)
    if cross is not None and cross.records_context:
        S = max(int(inp.context_mask.sum(1).max()) for inp in inputs.values())
        fit = cross.fit(RecordedContext(dict(inputs), {}, S, _no_rope), step=None)
    out = {}
    for layer_idx in sorted(inputs):
        inp = inputs[layer_idx]
        seg = compressor(inp if fit is None else dataclasses.replace(inp, fit=fit))
        out[layer_idx] = StoredSegment.from_segment(seg, inp.context_mask.sum(1))
    return out


def _no_rope(positions: torch.Tensor, dtype: torch.dtype):
    raise NotImplementedError("the shared prefill records post-RoPE keys; nothing re-rotates")


def _select(seg: StoredSegment, rows: torch.Tensor) -> StoredSegment:
    """The segment of the batch rows ``rows`` (every per-sample tensor indexed on dim 0)."""

    def pick(x):
        return None if x is None else x.index_select(0, rows)

    quant = seg.quant
    if quant is not None:
        quant = dataclasses.replace(
            quant,
            k_data=pick(quant.k_data),
            v_data=pick(quant.v_data),
            k_scale=pick(quant.k_scale),
            v_scale=pick(quant.v_scale),
        )
    if seg.lowrank is not None:
        raise NotImplementedError("row selection of a low-rank (xKV) segment")
    return dataclasses.replace(
        seg,
        head_map=pick(seg.head_map),
        groups=pick(seg.groups),
        quant=quant,
        keys=pick(seg.keys),
        values=pick(seg.values),
        counts=pick(seg.counts),
        valid=pick(seg.valid),
        context_tokens=pick(seg.context_tokens),
        positions=pick(seg.positions),
    )


def sample_kv_bytes(segs: Mapping[int, StoredSegment], cache_dtype_bytes: int = 2):
    """Per sample: stored bytes (payload + scales + the metadata compression made necessary:
    merge counts, head maps) and the uncompressed 16-bit bytes, summed over layers."""
    kv = base = None
    for seg in segs.values():
        if seg.quant is not None:
            dk, dv = seg.quant.head_dim, seg.quant.value_dim or seg.quant.head_dim
        else:
            assert seg.keys is not None and seg.values is not None
            dk, dv = seg.keys.shape[-1], seg.values.shape[-1]
        stored = stored_kv_bytes(
            seg.valid,
            seg.groups,
            dk,
            dv,
            quant=seg.quant,
            latent=seg.latent,
            dtype_bytes=cache_dtype_bytes,
        ).double()
        merged = (seg.valid & (seg.counts > 1)).any(1)  # [B]
        stored = stored + torch.where(merged, 2.0 * seg.valid.sum(1), 0.0)
        Hk = seg.head_map.shape[1]
        stored = stored + torch.where(seg.groups < Hk, float(Hk), 0.0)
        b = uncompressed_kv_bytes(
            seg.context_tokens, Hk, seg.key_dim, seg.value_dim, dtype_bytes=cache_dtype_bytes
        )
        kv = stored if kv is None else kv + stored
        base = b if base is None else base + b
    assert kv is not None and base is not None
    return [int(round(float(x))) for x in kv], [int(round(float(x))) for x in base]


# ------------------------------------------------------------------------------ decoding
@torch.no_grad()
def _decode(
    model,
    segs: Mapping[int, StoredSegment],
    split: torch.Tensor,
    prompts: Sequence[list[int]],
    max_new: Sequence[int],
    first_logits: torch.Tensor | None = None,
) -> list[list[int]]:
    """Feed each row's ``prompts[b]`` after its compressed context (positions continue at
    ``split[b]``) and generate ``max_new[b]`` tokens greedily; a row with an empty prompt starts
    from ``first_logits[b]`` (the prefill's last logits)."""
    device = split.device
    L = model.config.num_hidden_layers
    cache = CompressedKVCache(L)
    for layer_idx, seg in segs.items():
        cache.set_segment(layer_idx, seg, dtype=next(model.parameters()).dtype)
    B = len(prompts)
    q_len = [len(p) for p in prompts]
    total = max(q + n for q, n in zip(q_len, max_new))
    gen: list[list[int]] = [[] for _ in range(B)]
    nxt = torch.zeros(B, dtype=torch.long, device=device)
    if first_logits is not None:
        nxt = first_logits.float().argmax(-1)
        for b in range(B):
            if q_len[b] == 0:
                gen[b].append(int(nxt[b]))
    mods = torch.zeros(B, 1, dtype=torch.long, device=device)
    # The common prompt prefix goes in one block, then one token per row per step.
    start = min(q_len)
    if start > 0:
        block = torch.tensor([p[:start] for p in prompts], device=device)  # [B, start]
        pos = split[:, None] + torch.arange(start, device=device)
        logits = model(
            block,
            positions=pos,
            modality_ids=torch.zeros_like(block),
            cache=cache,
            logits_at=torch.full((B, 1), start - 1, dtype=torch.long, device=device),
        ).logits[:, -1]
        nxt = logits.float().argmax(-1)
        for b in range(B):
            if q_len[b] == start:
                gen[b].append(int(nxt[b]))
    for j in range(start, total - 1):
        feed = []
        for b in range(B):
            if j < q_len[b]:
                feed.append(prompts[b][j])
            else:
                feed.append(gen[b][-1] if gen[b] else 0)
        tok = torch.tensor(feed, device=device)[:, None]
        logits = model(tok, positions=(split + j)[:, None], modality_ids=mods, cache=cache)
        nxt = logits.logits[:, 0].float().argmax(-1)
        for b in range(B):
            if j >= q_len[b] - 1 and len(gen[b]) < max_new[b]:
                gen[b].append(int(nxt[b]))
    return [g[:n] for g, n in zip(gen, max_new)]


@torch.no_grad()
def run_long_context(
    model,
    tokenizer,
    records: Sequence[dict],
    settings: Mapping[str, Any],
    *,
    mode: str = "agnostic",
    batch_size: int = 8,
    progress: bool = False,
    on_batch: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, LongContextResult], dict[str, float]]:
    """Evaluate every setting on every record, one uncompressed prefill per context.

    Args:
        model: a GQA :class:`~unicache_train.model.Decoder` (eval mode; no sliding windows).
        tokenizer: our tokenizer API (``encode(text, add_bos=)``, ``decode``, ``pad_token_id``).
        records: from :func:`~unicache_train.data.long_context.long_context_records`.
        settings: name -> compressor (``IdentityCompressor()`` for the uncompressed row), or
            name -> ``callable(model) -> compressor``.
        mode: one of :data:`MODES`.
        batch_size: contexts per prefill (sorted by length, so padding stays small).
        progress: a progress bar over batches.
        on_batch: called with ``(done, total)`` after each batch (e.g. to save partial rows).

    Returns:
        ({setting: :class:`LongContextResult`}, timing ``{"prefill_s", "total_s"}``).
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is out of range; allowed {list(MODES)}")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} is out of range; allowed >= 1")
    comps = {}
    for name, s in settings.items():
        comp = s if hasattr(s, "pre_rope") else s(model)  # a compressor, or a factory
        _check(model, comp, name)
        comps[name] = comp
    device = next(model.parameters()).device
    t_all = time.perf_counter()
    prefix = [r["context"] + (r["question"] if mode == "aware" else "") for r in records]
    ctx_ids = [tokenizer.encode(t, add_bos=True) for t in prefix]
    order = sorted(range(len(records)), key=lambda i: (len(ctx_ids[i]), i))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    results = {name: LongContextResult() for name in comps}
    bar = batches
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(batches, desc="long-context", leave=False)
    prefill_s = 0.0
    for done, idx in enumerate(bar, 1):
        P = max(len(ctx_ids[i]) for i in idx)
        ids = torch.full((len(idx), P), tokenizer.pad_token_id, dtype=torch.long)
        for b, i in enumerate(idx):
            ids[b, : len(ctx_ids[i])] = torch.tensor(ctx_ids[i])
        ids = ids.to(device)
        split = torch.tensor([len(ctx_ids[i]) for i in idx], device=device)
        t0 = time.perf_counter()
        capture = RecordingCompressor()
        out = model(ids, split=split, compressor=capture, logits_at=(split - 1)[:, None])
        first = out.logits[:, 0]  # [B, V]
        prefill_s += time.perf_counter() - t0
        # What each row decodes: (batch row, question index, prompt tokens, answers).
        jobs: list[tuple[int, int, list[int], list[str]]] = []
        for b, i in enumerate(idx):
            r = records[i]
            if mode == "questions":
                qs = r.get("questions") or [{"question": r["question"], "answers": r["answers"]}]
                for k, q in enumerate(qs):
                    jobs.append((b, k, tokenizer.encode(q["question"]), list(q["answers"])))
            elif mode == "aware":
                jobs.append((b, 0, [], list(r["answers"])))
            else:
                jobs.append((b, 0, tokenizer.encode(r["question"]), list(r["answers"])))
        for name, comp in comps.items():
            t1 = time.perf_counter()
            segs = segments_for(capture.inputs, comp)
            kv, base = sample_kv_bytes(segs)
            for k in sorted({j[1] for j in jobs}):
                group = [j for j in jobs if j[1] == k]
                rows = torch.tensor([j[0] for j in group], device=device)
                sub = {layer: _select(s, rows) for layer, s in segs.items()}
                max_new = [
                    len(tokenizer.encode(" " + ", ".join(j[3]))) + ANSWER_MARGIN for j in group
                ]
                gen = _decode(
                    model,
                    sub,
                    split.index_select(0, rows),
                    [j[2] for j in group],
                    max_new,
                    first_logits=first.index_select(0, rows),
                )
                for (b, qk, _, answers), g in zip(group, gen):
                    r = records[idx[b]]
                    pred = tokenizer.decode(g)
                    results[name].rows.append(
                        {
                            "id": r["id"],
                            "task": r.get("task"),
                            "family": r.get("family"),
                            "question_index": qk,
                            "prediction": pred,
                            "answers": answers,
                            "correct": score_prediction(pred, answers),
                            "tokens": int(split[b]) - 1,
                            "kv_bytes": kv[b],
                            "baseline_bytes": base[b],
                        }
                    )
            results[name].seconds += time.perf_counter() - t1
        del capture, out
        if on_batch is not None:
            on_batch(done, len(batches))
    rank = {r["id"]: n for n, r in enumerate(records)}
    for res in results.values():
        res.rows.sort(key=lambda row: (rank[row["id"]], row["question_index"]))
    timing = {"prefill_s": prefill_s, "total_s": time.perf_counter() - t_all}
    return results, timing


@torch.no_grad()
def continuation_nll(
    model,
    windows: Sequence[Sequence[int]],
    split: int,
    settings: Mapping[str, Any],
    *,
    ids: Sequence[str] | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> dict[str, list[dict[str, Any]]]:
    """Per window and setting: the NLL of the tokens after ``split`` given the compressed cache
    of the tokens before it (query-agnostic: nothing after ``split`` is seen by the compressor).

    Args:
        model: a GQA :class:`~unicache_train.model.Decoder` (eval mode; no sliding windows).
        windows: token ids, all of one length ``T > split`` (``[bos] +`` text, as the caller
            encodes it).
        split: context tokens compressed (``1 <= split < T``); ``T - split`` tokens are scored.
        settings: name -> compressor (``IdentityCompressor()`` for the uncompressed row), or
            name -> ``callable(model) -> compressor``.
        ids: one name per window (default ``"window/<i>"``).
        batch_size: windows per prefill.
        progress: a progress bar over batches.

    Returns:
        ``{setting: rows}``, one row per window in input order: ``id``, ``nll`` (nats, summed),
        ``tokens`` (scored), ``kv_bytes``, ``baseline_bytes``.

    Raises:
        ValueError: windows of different lengths, ``split`` out of range, ``ids`` of another
            length, ``batch_size < 1``.
    """
    if not windows:
        raise ValueError("windows is empty; pass at least one window of token ids")
    T = len(windows[0])
    if any(len(w) != T for w in windows):
        raise ValueError(
            f"windows have lengths {sorted({len(w) for w in windows})}; all must have one length"
        )
    if not 1 <= split < T:
        raise ValueError(f"split={split} is out of range; allowed 1 <= split < {T} (window length)")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} is out of range; allowed >= 1")
    names = list(ids) if ids is not None else [f"window/{i}" for i in range(len(windows))]
    if len(names) != len(windows):
        raise ValueError(f"ids has {len(names)} entries for {len(windows)} windows")
    comps = {}
    for name, s in settings.items():
        comp = s if hasattr(s, "pre_rope") else s(model)
        _check(model, comp, name)
        comps[name] = comp
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    L = model.config.num_hidden_layers
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in comps}
    starts = list(range(0, len(windows), batch_size))
    bar: Any = starts
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(starts, desc="continuation NLL", leave=False)
    for s0 in bar:
        rows = list(range(s0, min(s0 + batch_size, len(windows))))
        full = torch.tensor([list(windows[i]) for i in rows], dtype=torch.long, device=device)
        B = full.shape[0]
        ctx, cont = full[:, :split], full[:, split:]
        sp = torch.full((B,), split, dtype=torch.long, device=device)
        capture = RecordingCompressor()
        first = model(ctx, split=sp, compressor=capture, logits_at=(sp - 1)[:, None]).logits
        for name, comp in comps.items():
            segs = segments_for(capture.inputs, comp)
            kv, base = sample_kv_bytes(segs)
            cache = CompressedKVCache(L)
            for layer_idx, seg in segs.items():
                cache.set_segment(layer_idx, seg, dtype=dtype)
            logits = first[:, :1]
            if cont.shape[1] > 1:
                pos = split + torch.arange(cont.shape[1] - 1, device=device)
                block = model(
                    cont[:, :-1],
                    positions=pos[None].expand(B, -1),
                    modality_ids=torch.zeros_like(cont[:, :-1]),
                    cache=cache,
                ).logits
                logits = torch.cat([logits, block], 1)
            logits = logits.float()  # [B, T - split, V]
            nll = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), cont.flatten(), reduction="none"
            ).view(B, -1)
            for b, i in enumerate(rows):
                out[name].append(
                    {
                        "id": names[i],
                        "nll": float(nll[b].sum()),
                        "tokens": int(cont.shape[1]),
                        "kv_bytes": kv[b],
                        "baseline_bytes": base[b],
                    }
                )
        del capture
    return out
