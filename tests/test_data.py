"""Data layer: tokenizers, the synthetic corpus, LMDataModule batching, files, errors, resume."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from unicache_train.data import (
    ByteTokenizer,
    HFTokenizer,
    LMDataModule,
    SeededSampler,
    load_tokenizer,
    recall_examples,
    score_recall,
    stories,
    synthetic_corpus,
)
from unicache_train.data.config import DataConfig, SyntheticDataConfig
from unicache_train.data.synthetic import ATTRIBUTES, OBJECTS
from unicache_train.model.config import ModelConfig
from unicache_train.validation import ConfigError

SMALL = SyntheticDataConfig(seed=7, num_stories=40, num_recall=40)


def _dm(tmp_path=None, **kw) -> LMDataModule:
    kw.setdefault("synthetic", SMALL)
    dm = LMDataModule(DataConfig(**kw), cache_dir=str(tmp_path / "hf") if tmp_path else None)
    dm.setup()
    return dm


def _all_batches(loader) -> dict[str, torch.Tensor]:
    batches = list(loader)
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


# ----------------------------------------------------------------------------- tokenizers
def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    assert tok.vocab_size == 260 == ModelConfig().vocab_size
    text = "Mira put the blue key in the cellar. naïve café – 東京 🚀"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert max(ids[1:-1]) < 256 and len(ids) == len(text.encode()) + 2
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=False) == f"<bos>{text}<eos>"
    assert tok.encode_batch([text, ""]) == [ids[1:-1], []]
    assert tok.decode([0xE6, 0x9D]) == "\ufffd"  # truncated UTF-8
    with pytest.raises(ValueError, match="260"):
        tok.decode([260])


def _save_hf_tokenizer(path, texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)


def test_hf_tokenizer_from_local_dir(tmp_path):
    corpus = synthetic_corpus(SMALL)
    _save_hf_tokenizer(tmp_path / "tok", corpus["text"])
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == len(tok.tok) and tok.pad_token_id == 0
    text = "Mira put the blue key in the cellar."
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert len(ids) < len(text)  # BPE merged something
    assert tok.decode(ids) == text
    # The split lands on the answer's first token with a subword tokenizer too.
    dm = LMDataModule(
        DataConfig(synthetic=SMALL, pack=False, seq_len=256, val_fraction=0.0),
        tokenizer=tok,
    )
    dm.setup()
    ds = dm.train_dataset
    answers = {r["prompt"]: r["answer"] for r in recall_examples(40, 7)}
    checked = 0
    for i in range(len(ds)):
        ids, s = ds[i]
        if s < 0:
            continue
        prompt = tok.decode(ids[:s])
        assert tok.decode(ids[s:]).startswith(answers[prompt])
        checked += 1
    assert checked == 40


def test_load_tokenizer_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such_tok"):
        load_tokenizer(str(tmp_path / "no_such_tok"))


# ----------------------------------------------------------------------------- corpus
def test_corpus_is_deterministic_and_seeded():
    a, b = synthetic_corpus(SMALL), synthetic_corpus(SMALL)
    assert a["text"] == b["text"] and a["split_char"] == b["split_char"]
    c = synthetic_corpus(SyntheticDataConfig(seed=8, num_stories=40, num_recall=40))
    assert sum(x != y for x, y in zip(a["text"], c["text"])) > 70
    assert a.column_names == ["text", "kind", "split_char", "question_char"]
    assert sorted(set(a["kind"])) == ["recall", "story"]
    for kind, s in zip(a["kind"], a["split_char"]):
        assert (s == -1) == (kind == "story")
    # Record i depends on (seed, i) only: shorter corpora are prefixes.
    assert list(stories(5, 3)) == list(stories(9, 3))[:5]


def test_recall_records_answer_is_a_fact_far_back():
    for r in recall_examples(200, seed=1, num_facts=16, num_questions=3, num_filler=2):
        text, s, q = r["text"], r["split_char"], r["question_char"]
        assert r["prompt"] == text[:s] and r["prompt"].endswith("A: ")
        assert text[s:].startswith(r["answer"]) and r["answer"] == r["answers"][0]
        assert text[q:].startswith(f"Q: what is {r['questions'][0]}? A: ")
        facts = [ln for ln in text[:q].splitlines() if re.fullmatch(r"[a-z]{4}: \w+", ln)]
        assert len(facts) == 16
        assert len({f.split(":")[0] for f in facts}) == 16  # unique keys
        for key, value in zip(r["questions"], r["answers"]):
            assert f"{key}: {value}" in facts[:8]  # asked from the first half
            assert f"Q: what is {key}? A: {value}" in text[q:]


def test_stories_recur_entities_at_long_range():
    pattern = re.compile(rf"the ((?:{'|'.join(ATTRIBUTES)}) (?:{'|'.join(OBJECTS)}))\b")
    texts = list(stories(200, seed=0))
    far = 0
    for text in texts:
        spans: dict[str, list[int]] = {}
        for m in pattern.finditer(text):
            spans.setdefault(m.group(1), []).append(m.start())
        if any(pos[-1] - pos[0] > 200 for pos in spans.values()):
            far += 1
    assert far / len(texts) >= 0.9


def test_record_lengths_fit_default_seq_len():
    lengths = [len(r["text"].encode()) for r in recall_examples(300, seed=0)]
    assert max(lengths) + 2 <= DataConfig().seq_len  # + bos/eos
    story_lengths = [len(t.encode()) for t in stories(300, seed=0)]
    assert 300 <= min(story_lengths) and max(story_lengths) <= 900


def test_score_recall():
    assert score_recall(
        [" 4821\nQ: what is abcd? A: 1", "tiger", "x"], ["4821", "tiger ", "y"]
    ) == (pytest.approx(2 / 3))
    with pytest.raises(ValueError, match="predictions"):
        score_recall(["a"], ["a", "b"])


# ----------------------------------------------------------------------------- batching
def test_packed_batches_shift_and_shapes():
    dm = _dm(seq_len=64, batch_size=4, pack=True)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "modality_ids", "split"}
    assert all(v.dtype == torch.long for v in batch.values())
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 64)
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
    assert batch["split"].tolist() == [-1] * 4 and not batch["modality_ids"].any()
    ds = dm.train_dataset
    tok = dm.tokenizer
    # Stride T with T + 1 tokens: the last target of block i is the first input of block i + 1.
    assert ds[0][-1] == ds[1][0]
    assert len(ds) == (dm.stats["train_tokens"] - 1) // 64
    stream = np.concatenate([ds[i][:-1] for i in range(len(ds))])
    assert (stream == tok.eos_token_id).sum() >= 60  # documents are eos-separated
    assert (stream == tok.pad_token_id).sum() == 0


def test_unpacked_padding_labels_and_split():
    dm = _dm(seq_len=320, batch_size=80, pack=False, val_fraction=0.0)
    b = _all_batches(dm.train_dataloader())
    tok = dm.tokenizer
    texts = {r["prompt"]: r for r in recall_examples(40, 7)}
    n_split = 0
    for ids, labels, s in zip(b["input_ids"], b["labels"], b["split"].tolist()):
        valid = labels != -100
        n = int(valid.sum())  # labelled positions: a prefix
        assert ids[0] == tok.bos_token_id and valid[:n].all()
        assert torch.equal(labels[: n - 1], ids[1:n])
        if n < 320:  # not truncated: eos, then padding
            assert labels[n - 1] == tok.eos_token_id
            assert torch.all(ids[n + 1 :] == tok.pad_token_id)
        if s >= 0:
            n_split += 1
            record = texts[tok.decode(ids[:s])]
            assert tok.decode(ids[s:n]).startswith(record["answer"])
            assert labels[s - 1] == ids[s]  # the first answer token is the label at s - 1
    assert n_split == 40


def test_split_at_question_and_prompt_loss():
    dm = _dm(
        seq_len=320,
        batch_size=80,
        pack=False,
        val_fraction=0.0,
        split_at="question",
        prompt_loss=False,
    )
    b = _all_batches(dm.train_dataloader())
    for ids, labels, s in zip(b["input_ids"], b["labels"], b["split"].tolist()):
        if s < 0:
            assert (labels != -100).sum() > 100  # stories keep every label
            continue
        assert dm.tokenizer.decode(ids[s:]).startswith("Q: what is ")
        assert (labels[: s - 1] == -100).all() and labels[s - 1] == ids[s]


def test_truncated_split_warns_and_is_dropped():
    with pytest.warns(UserWarning, match="split past seq_len=128"):
        dm = _dm(seq_len=128, pack=False, val_fraction=0.0)
    assert dm.stats["train_truncated_splits"] == 40
    assert (dm.train_dataset.splits == -1).all()


def test_train_order_is_seeded_and_changes_per_epoch():
    def first_rows(seed, epoch=0):
        dm = _dm(seq_len=64, batch_size=8, seed=seed)
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(epoch)
        return next(iter(loader))["input_ids"][:, :8]

    assert torch.equal(first_rows(0), first_rows(0))
    assert not torch.equal(first_rows(0), first_rows(1))
    assert not torch.equal(first_rows(0), first_rows(0, epoch=1))
    dm = _dm(seq_len=64, val_fraction=0.1)
    val = _all_batches(dm.val_dataloader())["input_ids"]
    assert torch.equal(val, _all_batches(dm.val_dataloader())["input_ids"])  # not shuffled
    assert dm.stats["val_documents"] == 8


# ----------------------------------------------------------------------------- local files
def test_local_txt_jsonl_parquet(tmp_path):
    docs = ["first document\nwith two lines", "second document", "third one, ünïcode"]
    for i, d in enumerate(docs):
        (tmp_path / f"doc{i}.txt").write_text(d)
    dm = _dm(tmp_path, source=str(tmp_path / "*.txt"), seq_len=8, batch_size=2, val_fraction=0)
    assert dm.stats["train_documents"] == 3
    expected = sum(len(d.encode()) + 2 for d in docs)  # bos + bytes + eos
    assert dm.stats["train_tokens"] == expected
    dm = _dm(
        tmp_path,
        source=str(tmp_path / "doc0.txt"),
        text_sample_by="line",
        seq_len=4,
        val_fraction=0,
    )
    assert dm.stats["train_documents"] == 2

    rows = [{"body": f"record number {i}", "split_char": 7 if i % 2 else -1} for i in range(10)]
    jsonl = tmp_path / "data" / "a.jsonl"
    jsonl.parent.mkdir()
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    dm = _dm(
        tmp_path,
        source=str(jsonl.parent),
        text_field="body",
        pack=False,
        seq_len=32,
        batch_size=10,
        val_fraction=0,
    )
    b = _all_batches(dm.train_dataloader())
    assert sorted(b["split"].tolist()) == [-1] * 5 + [8] * 5  # bos + "record " (7 bytes)

    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": [f"parquet row {i}" for i in range(20)]}), parquet)
    dm = _dm(tmp_path, source=[str(parquet)], seq_len=16, batch_size=4, val_fraction=0.25)
    assert dm.stats["train_documents"] == 15 and dm.stats["val_documents"] == 5
    assert next(iter(dm.train_dataloader()))["input_ids"].shape == (4, 16)


# ----------------------------------------------------------------------------- errors
def test_clear_errors_for_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        _dm(tmp_path, source=str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"glob .*\*\.parquet"):
        _dm(tmp_path, source=str(tmp_path / "*.parquet"))
    (tmp_path / "a.jsonl").write_text('{"body": "x", "id": 1}\n')
    with pytest.raises(ConfigError, match=r"text_field='text'.*columns found: \['body', 'id'\]"):
        _dm(tmp_path, source=str(tmp_path / "a.jsonl"))
    (tmp_path / "a.csv").write_text("text\nx\n")
    with pytest.raises(ValueError, match="unsupported file type .*a.csv"):
        _dm(tmp_path, source=str(tmp_path / "a.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        _dm(tmp_path, source=str(tmp_path / "empty"))


@pytest.mark.parametrize(
    ("cls", "kwargs", "field"),
    [
        (DataConfig, {"seq_len": 1}, "seq_len"),
        (DataConfig, {"val_fraction": 1.0}, "val_fraction"),
        (DataConfig, {"batch_size": 0}, "batch_size"),
        (DataConfig, {"source": ["a.txt", ""]}, "source"),
        (DataConfig, {"text_field": ""}, "text_field"),
        (DataConfig, {"split_at": "middle"}, "split_at"),
        (DataConfig, {"text_sample_by": "word"}, "text_sample_by"),
        (DataConfig, {"prompt_loss": "no"}, "prompt_loss"),
        (SyntheticDataConfig, {"recall_num_questions": 13}, "recall_num_questions"),
        (SyntheticDataConfig, {"recall_num_filler": -1}, "recall_num_filler"),
        (SyntheticDataConfig, {"story_min_sentences": 3}, "story_min_sentences"),
        (SyntheticDataConfig, {"story_max_sentences": 5}, "story_max_sentences"),
    ],
)
def test_bad_config_values(cls, kwargs, field):
    with pytest.raises(ConfigError, match=field):
        cls(**kwargs)


# ----------------------------------------------------------------------------- resume
def test_seeded_sampler_shards_and_resumes():
    data = list(range(23))
    shards = [list(SeededSampler(data, seed=3, num_replicas=2, rank=r)) for r in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 12  # padded like DistributedSampler
    assert set(shards[0]) | set(shards[1]) == set(data)
    sampler = SeededSampler(data, seed=3)
    sampler.set_epoch(2)
    order = list(sampler)
    sampler.resume_at(2, 5)
    assert list(sampler) == order[5:]
    assert list(sampler) == order  # one-shot
    sampler.resume_at(1, 5)
    sampler.set_epoch(2)  # another epoch than the saved one: nothing is skipped
    assert list(sampler) == order and len(sampler) == 23


def test_resume_mid_epoch_continues_the_same_order(tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Recorder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen: list[tuple[int, ...]] = []

        def training_step(self, batch, batch_idx):
            self.seen.append(tuple(batch["input_ids"][:, :6].flatten().tolist()))
            return (self.w * batch["input_ids"].float().mean()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def fit(max_steps, ckpt=None, callbacks=()):
        cfg = DataConfig(
            synthetic=SyntheticDataConfig(num_stories=6, num_recall=6),
            seq_len=128,
            batch_size=7,
            val_fraction=0.0,
        )
        dm, model = LMDataModule(cfg), Recorder()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=max_steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=list(callbacks),
            default_root_dir=tmp_path,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
        return model.seen, dm

    every = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1)
    full, dm = fit(16, callbacks=[every])
    per_epoch = -(-len(dm.train_dataset) // 7)
    assert per_epoch == 6 and len(dm.train_dataset) % 7  # last batch partial
    assert full[:6] != full[6:12]  # a new order each epoch
    for step in (8, 12):  # mid epoch 1; end of epoch 1
        ckpt = next((tmp_path / "ck").glob(f"*step={step}.ckpt"))
        resumed, _ = fit(16, ckpt=str(ckpt))
        assert resumed == full[step:], f"resume from step {step}"
