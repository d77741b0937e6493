"""Serve an export with stock transformers ``generate()``, with and without the KV compression
it carries (:class:`unicache_train.transformers_cache.CompressedCache`).

Subcommands (each appends rows to its own CSV in ``benchmarks/results/``, after the date, the
machine and the 1-minute load):

* ``export-base``: the base SmolLM2-135M-Instruct (``make fetch``) as an export carrying the
  compression policy of the real-checkpoint study (UniCache int4 at 4x: text-style preset, rate
  0.059), so the serving figures need no fine-tune.
* ``speed``: prompts of ``--prompts`` tokens (real text: recall contexts), each decode path in
  ``--paths`` (``plain``: transformers' DynamicCache; ``packed``, ``int8``, ``buffer``,
  ``reference``: ``CompressedCache(decode_path=...)``) run round-robin ``--repeats`` times in
  one process; prefill seconds (wall and process CPU) and decode tokens/s of ``--new-tokens``
  generated greedily by ``generate()``; ratios to ``plain`` from the medians of the same run
  (``bench_serving_speed.csv``; each single run also goes to ``bench_serving_speed_raw.csv``
  as it finishes, so a stopped run keeps its repeats). With one thread the process CPU time is
  close to the unloaded wall time, so its ratio is the steadier one on a shared machine.
* ``decode``: decode steps alone, many interleaved repeats: each path prefills once, then
  ``--rounds`` rounds of ``--steps`` greedy steps per path, round-robin (the forward
  ``generate()`` calls each step); per-step wall and CPU medians and their ratios to ``plain``,
  and each path's first decode step (where the int8 and buffer paths unpack / dequantize the
  segment once) on its own (``bench_serving_decode.csv``). The way to compare decoding at 8k
  without paying an 8k prefill per repeat.
* ``memory``: one fresh process per (prompt length, path, batch): the peak resident memory of
  ``generate()`` (``ru_maxrss``) and the resident memory after loading the model, the K/V bytes
  the cache holds at the end (real element sizes: the plain cache's fp32 tensors; the compressed
  cache's packed payload + scales + metadata, decoded tokens and working buffers), and the
  16-bit baseline (``bench_serving_memory.csv``). ``--cap-mib`` marks whether each row's peak
  fits that memory cap: run it with ``--batches 1,2,4,...`` for the batch sweep.
* ``recall``: the key-value recall prompts of the real-checkpoint study through stock
  transformers (compressed or not) and through our own decoding loop on the same weights:
  accuracy, KV bytes, shared predictions (``bench_serving.csv``).

Usage::

    python benchmarks/bench_serving.py export-base --out ~/.cache/unicache_train/exports/sm_q4
    python benchmarks/bench_serving.py speed --export DIR --prompts 2000 --threads 1
    python benchmarks/bench_serving.py memory --export DIR --prompts 2000,4000,8000
    python benchmarks/bench_serving.py memory --export DIR --prompts 2000 --batches 1,2,4 \\
        --cap-mib 1536
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from bench_common import RESULTS_DIR, report

SMOLLM2 = Path.home() / ".cache" / "unicache_train" / "models" / "SmolLM2-135M-Instruct"
STUDY_RATE = 0.059  # the study's int4 rate at 4x (recipes/smollm2_compress.yaml)
PATHS = ("plain", "packed", "int8", "buffer", "reference")


# ------------------------------------------------------------------------------- export
def export_base(out: Path, source: Path = SMOLLM2, rate: float = STUDY_RATE) -> Path:
    """``source``'s files linked into ``out`` plus a UniCache int4 ``compression_config.json``."""
    from unicache_train.checkpoint.policy import write_compression_config
    from unicache_train.eval.budget import text_unicache

    if not (source / "config.json").is_file():
        raise SystemExit(f"{source} has no config.json: run `make fetch` first")
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        link = out / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    cfg = text_unicache(rate, quantize="int4")
    policy = {"method": "unicache", "preset": "text_style_baseline", "unicache": cfg.to_dict()}
    write_compression_config(policy, out)
    return out


# ------------------------------------------------------------------------------ prompts
def prompt_ids(tok, tokens: int, batch: int = 1, seed: int = 1000003) -> torch.Tensor:
    """[batch, tokens] real-text prompts: recall contexts (32 pairs each) joined until long
    enough, cut at ``tokens`` (each row from different records)."""
    from unicache_train.data.recall_task import RecallTask, recall_records

    rows = []
    for b in range(batch):
        ids: list[int] = [tok.bos_token_id] if tok.bos_token_id is not None else []
        k = 0
        while len(ids) < tokens:
            rec = recall_records(RecallTask(pairs=32), 1, seed + 1000 * b + k)[0]
            ids += tok.encode(rec["context"] + "\n", add_special_tokens=False)
            k += 1
        rows.append(ids[:tokens])
    return torch.tensor(rows)


def new_cache(export: Path, path: str):
    from transformers import DynamicCache

    from unicache_train.transformers_cache import CompressedCache

    if path == "plain":
        return DynamicCache()
    return CompressedCache.from_pretrained(export, decode_path=path)


def held_kv_bytes(cache, path: str) -> int:
    """K/V bytes the cache holds at its real element sizes."""
    if path == "plain":
        return sum(
            t.numel() * t.element_size()
            for layer in cache.layers
            for t in (layer.keys, layer.values)
            if t is not None
        )
    inner = cache.inner
    packed = 0
    for seg in inner.segments:
        q = seg.quant
        if q is not None:
            packed += sum(
                t.numel() * t.element_size() for t in (q.k_data, q.v_data, q.k_scale, q.v_scale)
            )
        else:  # unquantized segment (a policy without quantization)
            packed += sum(t.numel() * t.element_size() for t in (seg.keys, seg.values))
        packed += seg.counts.numel() * 2 + seg.head_map.numel()
    decoded = sum(
        t.numel() * t.element_size() for t in (*inner.keys, *inner.values) if t is not None
    )
    return packed + decoded + cache.working_bytes()


GEN = dict(do_sample=False, temperature=None, top_p=None, top_k=None)


def run_once(model, tok, export: Path, ids: torch.Tensor, new_tokens: int, path: str) -> dict:
    """Prefill by hand (timed), then ``generate()`` ``new_tokens`` more (timed)."""
    from unicache_train.transformers_cache import CACHE_ARGUMENT

    cache = new_cache(export, path)
    with torch.no_grad():
        w0, c0 = time.perf_counter(), time.process_time()
        model(ids, **{CACHE_ARGUMENT: cache}, logits_to_keep=1)
        w1, c1 = time.perf_counter(), time.process_time()
        full = torch.cat([ids, ids[:, -1:]], 1)  # one token to start decoding
        out = model.generate(
            full,
            attention_mask=torch.ones_like(full),
            **{CACHE_ARGUMENT: cache},
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=tok.pad_token_id,
            **GEN,
        )
        w2, c2 = time.perf_counter(), time.process_time()
    n = (out.shape[1] - full.shape[1]) * ids.shape[0]
    return dict(
        prefill_s=w1 - w0,
        prefill_cpu_s=c1 - c0,
        tps=n / (w2 - w1),
        tps_cpu=n / (c2 - c1),
        tokens=out[0, full.shape[1] :].tolist(),
        cache=cache,
    )


# -------------------------------------------------------------------------------- speed
def cmd_speed(args) -> None:
    from unicache_train.serve import load_export, prompt_kv_bytes

    torch.set_num_threads(args.threads)
    export = Path(args.export)
    paths = args.paths.split(",")
    models = {c: load_export(export, compressed=c) for c in (False, True)}
    tok = models[False][1]
    cfg = models[False][0].config
    for P in (int(p) for p in args.prompts.split(",")):
        ids = prompt_ids(tok, P)
        res: dict[str, list[dict]] = {p: [] for p in paths}
        loads = []
        for r in range(args.repeats):
            for p in paths:
                model = models[p != "plain"][0]
                res[p].append(run_once(model, tok, export, ids, args.new_tokens, p))
                loads.append(os.getloadavg()[0])
                x = res[p][-1]
                raw = {
                    "path": p,
                    "prompt_tokens": P,
                    "repeat": r,
                    **{k: f"{x[k]:.3f}" for k in ("prefill_s", "prefill_cpu_s", "tps", "tps_cpu")},
                }
                report(
                    f"run {r} {p}",
                    [raw],
                    "bench_serving_speed_raw",
                    {"export": export.name, "threads": args.threads, "new_tokens": args.new_tokens},
                )
                print(
                    f"P={P} repeat {r} {p:9s} prefill {x['prefill_s']:.2f}s "
                    f"(cpu {x['prefill_cpu_s']:.2f}) decode {x['tps']:.2f} tok/s "
                    f"(cpu {x['tps_cpu']:.2f}) load {loads[-1]:.2f}",
                    flush=True,
                )

        def med(p: str, key: str, res: dict = res) -> float:
            return statistics.median(x[key] for x in res[p])

        base = {k: med("plain", k) for k in ("prefill_s", "prefill_cpu_s", "tps", "tps_cpu")}
        rows = []
        for p in paths:
            cache = res[p][-1]["cache"]
            stored = prompt_kv_bytes(cfg, P) if p == "plain" else cache.kv_bytes()
            rows.append(
                {
                    "path": p,
                    "prompt_tokens": P,
                    "new_tokens": args.new_tokens,
                    "repeats": args.repeats,
                    "prefill_s": f"{med(p, 'prefill_s'):.2f}",
                    "prefill_ratio": f"{med(p, 'prefill_s') / base['prefill_s']:.3f}",
                    "prefill_cpu_ratio": f"{med(p, 'prefill_cpu_s') / base['prefill_cpu_s']:.3f}",
                    "decode_tps": f"{med(p, 'tps'):.3f}",
                    "decode_ratio": f"{med(p, 'tps') / base['tps']:.3f}",
                    "decode_cpu_ratio": f"{med(p, 'tps_cpu') / base['tps_cpu']:.3f}",
                    "stored_kv_bytes_16bit": stored,
                    "reduction": f"{prompt_kv_bytes(cfg, P) / stored:.3f}",
                    "same_tokens_as_packed": (
                        res[p][-1]["tokens"] == res["packed"][-1]["tokens"]
                        if "packed" in res
                        else ""
                    ),
                    "load_min_max": f"{min(loads):.1f}-{max(loads):.1f}",
                }
            )
        report(
            f"serving speed, {P}-token prompt",
            rows,
            "bench_serving_speed",
            {"export": export.name, "threads": args.threads},
        )


# ------------------------------------------------------------------------------- decode
def cmd_decode(args) -> None:
    """Prefill once per path, then decode steps round-robin: ``--rounds`` rounds of ``--steps``
    greedy steps per path (the forward ``generate()`` runs each step, with its cache)."""
    from unicache_train.serve import load_export
    from unicache_train.transformers_cache import CACHE_ARGUMENT

    torch.set_num_threads(args.threads)
    export = Path(args.export)
    paths = args.paths.split(",")
    models = {c: load_export(export, compressed=c)[0] for c in (False, True)}
    tok = load_export(export, compressed=False)[1]
    for P in (int(p) for p in args.prompts.split(",")):
        ids = prompt_ids(tok, P)
        state, first = {}, {}
        with torch.no_grad():
            for p in paths:
                model = models[p != "plain"]
                cache = new_cache(export, p)
                out = model(ids, **{CACHE_ARGUMENT: cache}, logits_to_keep=1)
                nxt = out.logits[:, -1:].argmax(-1)
                c0 = time.process_time()  # the first step: the int8/buffer paths' one-time work
                out = model(nxt, **{CACHE_ARGUMENT: cache})
                first[p] = time.process_time() - c0
                state[p] = [model, cache, out.logits[:, -1:].argmax(-1)]
                print(f"P={P} {p} prefilled; first step {first[p]:.3f} s cpu", flush=True)
            times: dict[str, list[tuple[float, float]]] = {p: [] for p in paths}
            loads = []
            for _ in range(args.rounds):
                for p in paths:
                    model, cache, nxt = state[p]
                    w0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(args.steps):
                        nxt = model(nxt, **{CACHE_ARGUMENT: cache}).logits[:, -1:].argmax(-1)
                    times[p].append(
                        (
                            (time.perf_counter() - w0) / args.steps,
                            (time.process_time() - c0) / args.steps,
                        )
                    )
                    state[p][2] = nxt
                    loads.append(os.getloadavg()[0])
        wall = {p: statistics.median(t[0] for t in times[p]) for p in paths}
        cpu = {p: statistics.median(t[1] for t in times[p]) for p in paths}
        rows = [
            {
                "path": p,
                "prompt_tokens": P,
                "rounds": args.rounds,
                "steps": args.steps,
                "step_ms": f"{wall[p] * 1e3:.1f}",
                "step_cpu_ms": f"{cpu[p] * 1e3:.1f}",
                "tps_ratio": f"{wall['plain'] / wall[p]:.3f}",
                "tps_cpu_ratio": f"{cpu['plain'] / cpu[p]:.3f}",
                "first_step_cpu_s": f"{first[p]:.3f}",
                "working_bytes": state[p][1].working_bytes() if p != "plain" else 0,
                "load_min_max": f"{min(loads):.1f}-{max(loads):.1f}",
            }
            for p in paths
        ]
        report(
            f"decode steps, {P}-token prompt",
            rows,
            "bench_serving_decode",
            {"export": export.name, "threads": args.threads},
        )


# ------------------------------------------------------------------------------- memory
def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def cmd_memory_child(args) -> None:
    """One generate() in this fresh process; prints a JSON line."""
    from unicache_train.serve import load_export, prompt_kv_bytes

    torch.set_num_threads(args.threads)
    export = Path(args.export)
    model, tok = load_export(export, compressed=args.path != "plain")
    ids = prompt_ids(tok, args.prompt, args.batch)
    loaded = _rss_mib()
    peak_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    x = run_once(model, tok, export, ids, args.new_tokens, args.path)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "rss_after_load_mib": round(loaded, 1),
                "peak_before_mib": round(peak_loaded, 1),
                "peak_rss_mib": round(peak, 1),
                "held_kv_bytes": held_kv_bytes(x["cache"], args.path),
                "baseline_kv_bytes_16bit": prompt_kv_bytes(model.config, args.prompt) * args.batch,
            }
        )
    )


def cmd_memory(args) -> None:
    rows = []
    for P in (int(p) for p in args.prompts.split(",")):
        for B in (int(b) for b in args.batches.split(",")):
            for p in args.paths.split(","):
                cmd = [
                    sys.executable,
                    __file__,
                    "_memory_child",
                    "--export",
                    args.export,
                    "--prompt",
                    str(P),
                    "--batch",
                    str(B),
                    "--path",
                    p,
                    "--new-tokens",
                    str(args.new_tokens),
                    "--threads",
                    str(args.threads),
                ]
                env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if proc.returncode:
                    print(proc.stderr[-3000:])
                    raise SystemExit(f"memory child failed: {' '.join(cmd)}")
                m = json.loads(proc.stdout.strip().splitlines()[-1])
                row = {
                    "path": p,
                    "prompt_tokens": P,
                    "batch": B,
                    **m,
                    "peak_above_load_mib": round(m["peak_rss_mib"] - m["rss_after_load_mib"], 1),
                    "held_kv_mib": round(m["held_kv_bytes"] / 2**20, 1),
                }
                if args.cap_mib:
                    row["cap_mib"] = args.cap_mib
                    row["fits_cap"] = m["peak_rss_mib"] <= args.cap_mib
                print(row, flush=True)
                rows.append(row)
                report(
                    f"generate() memory, {P} tokens, batch {B}, {p}",
                    [row],
                    "bench_serving_memory",
                    {
                        "export": Path(args.export).name,
                        "threads": args.threads,
                        "new_tokens": args.new_tokens,
                    },
                )


# ------------------------------------------------------------------------------- recall
def _recall_hf(model, tok, records, compressed: bool, export: Path):
    """Stock transformers: context prefilled (and compressed), question + answer generated."""
    from transformers import DynamicCache

    from unicache_train.serve import prompt_kv_bytes
    from unicache_train.transformers_cache import CACHE_ARGUMENT, CompressedCache

    preds, kv, base = [], 0, 0
    per_token = prompt_kv_bytes(model.config, 1)  # uncompressed 16-bit K/V bytes of one token
    for r in records:
        ctx = torch.tensor([tok.encode(r["context"], add_bos=True)])
        q = torch.tensor([tok.encode(r["question"])])
        n_ans = len(tok.encode(" " + r["answer"])) + 1
        cache = CompressedCache.from_pretrained(export) if compressed else DynamicCache()
        with torch.no_grad():
            model(ctx, **{CACHE_ARGUMENT: cache})  # prefill: the context is compressed here
            full = torch.cat([ctx, q], 1)
            out = model.generate(
                full,
                attention_mask=torch.ones_like(full),
                **{CACHE_ARGUMENT: cache},
                max_new_tokens=n_ans,
                pad_token_id=tok.pad_token_id,
                **GEN,
            )
        text = tok.decode(out[0, full.shape[1] :].tolist()).lstrip(" ").split("\n")[0].strip()
        preds.append(text)
        base += per_token * ctx.shape[1]
        kv += cache.kv_bytes() if compressed else per_token * ctx.shape[1]
    return preds, kv, base


def cmd_recall(args) -> None:
    from tqdm.auto import tqdm

    from unicache_train.checkpoint.hf import import_hf
    from unicache_train.checkpoint.policy import compressor_from_policy, read_policy
    from unicache_train.data.recall_task import RecallTask, recall_records
    from unicache_train.data.tokenizer import load_tokenizer
    from unicache_train.eval.recall import run_recall
    from unicache_train.serve import load_export

    torch.set_num_threads(args.threads)
    export = Path(args.export)
    policy = read_policy(export)
    if policy is None:
        raise SystemExit(f"{export} has no compression_config.json: nothing to compare")
    tok = load_tokenizer(str(export))
    records = recall_records(RecallTask(pairs=args.pairs), args.n, args.seed)
    rows = []

    def se(acc: float, n: int) -> float:
        return math.sqrt(max(acc * (1 - acc), 0.0) / n)

    ours_model, _ = import_hf(export)
    ours_model.eval()
    ours = run_recall(ours_model, tok, records, compressor_from_policy(policy), batch_size=8)
    del ours_model
    for compressed in (False, True):
        model, _ = load_export(export, compressed=compressed)
        t0 = time.perf_counter()
        preds, kv, base = _recall_hf(
            model, tok, tqdm(records, desc=f"recall c={compressed}"), compressed, export
        )
        secs = time.perf_counter() - t0
        acc = sum(p == r["answer"] for p, r in zip(preds, records)) / len(records)
        same = sum(a == b for a, b in zip(preds, ours.predictions)) if compressed else ""
        rows.append(
            dict(
                measure="recall",
                path="transformers",
                compressed=compressed,
                method=policy["method"] if compressed else "none",
                n=len(records),
                accuracy=round(acc, 4),
                stderr=round(se(acc, len(records)), 4),
                kv_bytes=kv,
                baseline_bytes=base,
                reduction=round(base / kv, 3),
                same_as_ours=same,
                seconds=round(secs, 1),
            )
        )
    acc = ours.accuracy
    rows.append(
        dict(
            measure="recall",
            path="unicache_train",
            compressed=True,
            method=policy["method"],
            n=ours.n,
            accuracy=round(acc, 4),
            stderr=round(se(acc, ours.n), 4),
            kv_bytes=ours.kv_bytes,
            baseline_bytes=ours.baseline_bytes,
            reduction=round(ours.baseline_bytes / ours.kv_bytes, 3),
            same_as_ours="",
            seconds="",
        )
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(r)
    print(f"wrote {out}")


# --------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export-base", help="base SmolLM2 + the study's int4 4x policy")
    e.add_argument("--out", required=True)
    e.add_argument("--source", default=str(SMOLLM2))
    e.add_argument("--rate", type=float, default=STUDY_RATE)
    for name in ("speed", "decode", "memory", "_memory_child", "recall"):
        s = sub.add_parser(name)
        s.add_argument("--export", required=True)
        s.add_argument("--threads", type=int, default=1)
        s.add_argument("--new-tokens", type=int, default=16)
        if name in ("speed", "decode", "memory"):
            s.add_argument("--prompts", default="2000", help="prompt lengths, comma-separated")
            s.add_argument(
                "--paths", default="plain,packed,buffer", help=f"comma-separated, from {PATHS}"
            )
        if name == "speed":
            s.add_argument("--repeats", type=int, default=3)
        if name == "decode":
            s.add_argument("--rounds", type=int, default=7)
            s.add_argument("--steps", type=int, default=4)
        if name == "memory":
            s.add_argument("--batches", default="1")
            s.add_argument("--cap-mib", type=float, default=0.0)
        if name == "_memory_child":
            s.add_argument("--prompt", type=int, required=True)
            s.add_argument("--batch", type=int, default=1)
            s.add_argument("--path", choices=PATHS, required=True)
        if name == "recall":
            s.add_argument("--n", type=int, default=32, help="recall records")
            s.add_argument("--seed", type=int, default=1000003, help="held-out record seed")
            s.add_argument("--pairs", type=int, default=8)
            s.add_argument("--out", default=str(RESULTS_DIR / "bench_serving.csv"))
    args = p.parse_args(argv)
    if args.cmd == "export-base":
        print(export_base(Path(args.out).expanduser(), Path(args.source), args.rate))
        return
    for name in getattr(args, "paths", "").split(","):
        if name and name not in PATHS:
            raise SystemExit(f"--paths: {name!r} is not one of {PATHS}")
    commands = {
        "speed": cmd_speed,
        "decode": cmd_decode,
        "memory": cmd_memory,
        "_memory_child": cmd_memory_child,
        "recall": cmd_recall,
    }
    commands[args.cmd](args)


if __name__ == "__main__":
    main()
