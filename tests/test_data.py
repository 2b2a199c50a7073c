"""Reading, cleaning, SentencePiece, caching and token-bucket batching (issue: data)."""

import errno
import hashlib
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from types import SimpleNamespace

import datasets
import httpx2
import huggingface_hub
import lightning as L
import numpy as np
import pytest
import sentencepiece as spm
import torch
from omegaconf import OmegaConf

import transformer_mt.data.cache as cache_module
import transformer_mt.data.datamodule as datamodule_module
from conftest import CONF, ROOT, SHARED_DATA, run_process, synthetic_corpus, tiny_config, write_corpus, write_pair
from transformer_mt.configs import compose, run_folder
from transformer_mt.data.batching import TokenBucketSampler, collate, padding_efficiency, update_shape
from transformer_mt.data.corpus import Corpus, drop_empty, length_filter, read_text_pair
from transformer_mt.data.datamodule import TranslationDataModule
from transformer_mt.errors import InputError, MissingInputError
from transformer_mt.files import read_lines
from transformer_mt.launcher import launch_id, launched_rank
from transformer_mt.model import Transformer
from transformer_mt.objective import sequence_losses
from transformer_mt.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer

TEXT_FILES = {"train": "train", "validation": "valid", "test": "test"}


def text_datamodule(tmp_path, n_train=400, **overrides) -> TranslationDataModule:
    corpus = tmp_path / "corpus"
    if not corpus.exists():  # written once per test; later modules reuse (or see edits to) it
        write_corpus(corpus, n_train)
    args = dict(
        name="synthetic",
        path=str(corpus),
        text_files=TEXT_FILES,
        vocab_size=400,
        max_len=64,
        max_tokens=256,
        cache_dir=str(tmp_path / "cache"),
    )
    args.update(overrides)
    return TranslationDataModule(**args)


# ---------------------------------------------------------------- bad input


def test_lines_split_on_newline_only_so_u0085_keeps_alignment(tmp_path):
    (tmp_path / "a.en").write_text("one\u0085still one\ntwo\n", encoding="utf-8")
    (tmp_path / "a.de").write_text("eins\nzwei\n", encoding="utf-8")
    src, tgt = read_text_pair(tmp_path / "a.en", tmp_path / "a.de")
    assert src == ["one\u0085still one", "two"] and tgt == ["eins", "zwei"]


def test_misaligned_files_name_both_files_and_counts(tmp_path):
    write_pair(tmp_path, "x", ["a", "b", "c"], ["a", "b"])
    with pytest.raises(ValueError, match=r"x\.en has 3 lines but .*x\.de has 2"):
        read_text_pair(tmp_path / "x.en", tmp_path / "x.de")


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.en"):
        read_lines(tmp_path / "nope.en")


def test_invalid_utf8_names_file_and_line(tmp_path):
    (tmp_path / "bad.de").write_bytes(b"gut\nauch gut\n" + b"schlecht \xe4\n")
    with pytest.raises(ValueError, match=r"bad\.de, line 3: invalid UTF-8"):
        read_lines(tmp_path / "bad.de")


def test_a_byte_order_mark_is_not_part_of_the_first_line(tmp_path):
    (tmp_path / "refs.de").write_bytes("\ufeffErste Zeile\nzweite\n".encode())
    assert read_lines(tmp_path / "refs.de") == ["Erste Zeile", "zweite"]


@pytest.mark.parametrize(
    "key, value",
    [
        ("max_tokens", -5), ("max_tokens", 0), ("max_tokens", "most"), ("max_tokens_fallback", 0),
        ("max_tokens_fallback", "auto"), ("vocab_size", 0), ("max_len", -1), ("tokens_per_update", 0),
    ],
)  # fmt: skip
def test_impossible_batch_settings_are_refused(tmp_path, key, value):
    with pytest.raises(InputError, match=rf"data\.{key}={value}: "):
        text_datamodule(tmp_path, **{key: value})


def test_a_corpus_takes_its_fields_from_a_data_config_and_leaves_the_rest(tmp_path):
    """Corpus.from_config picks the Corpus fields of a composed data config (conf/data/multi30k.yaml on
    default.yaml); the config's other keys (vocabulary, batching, cache) are the DataModule's and are passed
    over. An override wins; one that is no field is refused, as the DataModule refuses an unknown setting."""
    data = OmegaConf.to_container(compose("train", ["data=multi30k"]).data, resolve=True)
    assert {"vocab_size", "max_tokens", "cache_dir"} <= set(data)  # not Corpus fields
    corpus = Corpus.from_config(data)
    assert corpus == Corpus(
        "multi30k", "en", "de", hub_name="bentrevett/multi30k",
        text_files={"train": "train", "validation": "val", "test": "test_2016_flickr"},
    )  # fmt: skip
    assert Corpus.from_config(data, path=str(tmp_path)).path == str(tmp_path)
    assert Corpus.from_config({"name": "text", "text_files": None}).text_files == {}  # default.yaml's null
    with pytest.raises(TypeError, match="pth"):
        Corpus.from_config(data, pth=str(tmp_path))
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_tokenz'"):
        TranslationDataModule(**data, max_tokenz=4096)


def test_missing_split_names_what_was_looked_for(tmp_path):
    write_pair(tmp_path, "train", ["a"], ["b"])
    corpus = Corpus("c", path=str(tmp_path), text_files=TEXT_FILES)
    with pytest.raises(FileNotFoundError, match="valid.en"):
        corpus.load("validation")
    write_pair(tmp_path / "half", "train", ["a"], ["b"])
    (tmp_path / "half" / "train.de").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing .*train\.de"):
        Corpus("c", path=str(tmp_path / "half"), text_files=TEXT_FILES).load("train")


def test_empty_split_after_cleaning_is_an_error(tmp_path):
    dm = text_datamodule(tmp_path, max_len=1)  # every synthetic sentence has more tokens
    with pytest.raises(ValueError, match=r"corpus/train\.en and .*corpus/train\.de: the train split is empty after"):
        dm.build()


def test_empty_training_files_are_named(tmp_path):
    write_corpus(tmp_path / "corpus")
    for side in ("en", "de"):
        (tmp_path / "corpus" / f"train.{side}").write_text("\n\n")
    with pytest.raises(InputError, match=r"corpus/train\.en and .*corpus/train\.de: no training pair with text"):
        text_datamodule(tmp_path).build()


def test_a_pair_longer_than_the_models_positions_is_found_when_the_data_is_built(tmp_path):
    write_corpus(tmp_path / "corpus")
    valid = (tmp_path / "corpus" / "valid.de").read_text().splitlines()
    valid[6] = " ".join(["Katze"] * 70)  # line 7: about 70 tokens
    (tmp_path / "corpus" / "valid.de").write_text("\n".join(valid) + "\n")
    dm = text_datamodule(tmp_path, max_len=40)
    dm.build()
    dm.check_lengths(max_positions=256)  # fits a larger table
    with pytest.raises(InputError) as error:
        dm.check_lengths(max_positions=64)
    message = str(error.value)
    assert message.startswith(f"{tmp_path}/corpus/valid.en and {tmp_path}/corpus/valid.de, line 7: the target sentence")
    assert "more than model.max_positions=64 allows with EOS (0 more such pairs in validation)" in message
    assert "shorten or remove it" in message
    with pytest.raises(InputError, match=r"train\.de, line \d+: .* lower data\.max_len to 19 or less"):
        dm.check_lengths(max_positions=20)  # training pairs up to max_len=40 tokens


def test_training_pairs_longer_than_max_tokens_are_left_out_and_counted(tmp_path, caplog):
    dm = text_datamodule(tmp_path, max_tokens=12)
    dm.build()
    data = dm.splits["train"]
    too_long = np.maximum(data.src_lens, data.tgt_lens) + 1 > 12
    assert 0 < too_long.sum() < len(too_long)
    with caplog.at_level("INFO"):
        sampler = dm.sampler("train", shuffle=True)
    assert f"train: {too_long.sum()} pairs are longer than a batch's 12 tokens: left out of training" in caplog.text
    batched = np.concatenate(sampler.all_batches(0))
    assert sorted(batched.tolist()) == np.flatnonzero(~too_long).tolist()  # each short pair once, no long one
    for batch in sampler.all_batches(0):
        assert len(batch) * max(sampler.src_lens[batch].max(), sampler.tgt_lens[batch].max()) <= 12
    tiny = text_datamodule(tmp_path, max_tokens=2)
    tiny.build()
    with pytest.raises(InputError, match="no training pair fits 2 tokens per batch"):
        tiny.sampler("train", shuffle=True)


def test_a_killed_cache_write_is_cleaned_up_by_the_next_build(tmp_path):
    dm = text_datamodule(tmp_path)
    dm.build()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host, pid = socket.gethostname(), dead.stdout.strip()  # a process that has ended
    stale = tmp_path / "cache" / "corpus" / f".synthetic-train-x.tmp-{host}-{pid}-abcd"
    stale.mkdir()
    alive = tmp_path / "cache" / "corpus" / f".synthetic-valid-x.tmp-{host}-{os.getpid()}-abcd"  # still writing
    alive.mkdir()
    text_datamodule(tmp_path).build()
    assert not stale.exists() and alive.exists()


# ---------------------------------------------------------------- cleaning


def test_drop_empty_strips_and_counts():
    src, tgt, rows = drop_empty([" a ", "", "b", "c"], ["x", "y", "  ", " z\r"])
    assert (src, tgt, rows) == (["a", "c"], ["x", "z"], [0, 3])


def test_length_filter_counts_each_rule():
    src, tgt = np.array([3, 10, 4, 2, 6]), np.array([3, 4, 12, 7, 5])
    rule = length_filter(src, tgt, max_len=10, max_ratio=2.0)
    assert rule["keep"].tolist() == [True, False, False, False, True]
    assert rule["drops"] == {"longer than 10 tokens": 1, "length ratio above 2.0": 2}


# ---------------------------------------------------------------- SentencePiece


def test_shared_tokenizer_special_ids_byte_fallback_and_cache(tmp_path):
    dm = text_datamodule(tmp_path)
    dm.build()
    tok = dm.tokenizer
    assert (tok.sp.pad_id(), tok.sp.unk_id(), tok.sp.bos_id(), tok.sp.eos_id()) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)
    assert len(tok) == 400
    # Both languages are in one vocabulary.
    assert tok.sp.piece_to_id("▁Katze") != UNK_ID and tok.sp.piece_to_id("▁cat") != UNK_ID
    # Characters never seen in training become bytes, not <unk>, and decode back exactly.
    unseen = "Zebra 漢字 ☃ ü"
    ids = tok.encode([unseen])[0]
    assert UNK_ID not in ids and tok.decode([ids]) == [unseen]
    # decode() stops at EOS and drops BOS/PAD (what search output carries).
    ids = tok.encode(["the cat ."])[0]
    assert tok.decode([[BOS_ID, *ids, EOS_ID, *ids, PAD_ID]]) == ["the cat ."]
    # Trained once: a second module with the same inputs reuses the file untouched.
    mtime = tok.path.stat().st_mtime_ns
    again = text_datamodule(tmp_path)
    again.build()
    assert again.tokenizer.path == tok.path and tok.path.stat().st_mtime_ns == mtime
    # A different vocabulary size is a different model.
    other = text_datamodule(tmp_path, vocab_size=420)
    other.build()
    assert other.tokenizer.path != tok.path and len(other.tokenizer) == 420
    # Saved next to a checkpoint, it loads alone.
    assert len(Tokenizer(tok.save(tmp_path / "run"))) == 400


def test_tokenizer_rejects_missing_or_foreign_models(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.model"):
        Tokenizer(tmp_path / "missing.model")
    (tmp_path / "text.model").write_text("not a model\n")
    with pytest.raises(InputError, match=r"text\.model: not a SentencePiece model"):
        Tokenizer(tmp_path / "text.model")
    # A real SentencePiece model with its library's default ids (unk 0, bos 1, eos 2, no pad): not ours.
    en, de = synthetic_corpus(200)
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(en + de), model_writer=proto, vocab_size=40, minloglevel=2)
    (tmp_path / "default.model").write_bytes(proto.getvalue())
    with pytest.raises(
        InputError, match=r"special ids \(pad, unk, bos, eos\) are \(-1, 0, 1, 2\), expected \(0, 1, 2, 3\)"
    ):
        Tokenizer(tmp_path / "default.model")


# ---------------------------------------------------------------- tokenized corpus cache


def test_second_build_reads_the_cache(tmp_path):
    dm = text_datamodule(tmp_path)
    dm.build()
    assert {how for how, _ in dm.timings.values()} == {"tokenized"}
    again = text_datamodule(tmp_path)
    again.build()
    assert {how for how, _ in again.timings.values()} == {"loaded from cache"}
    for split in ("train", "validation", "test"):
        assert len(again.splits[split]) == len(dm.splits[split])
        for a, b in zip(again.splits[split], dm.splits[split], strict=True):
            np.testing.assert_array_equal(a[0], b[0])
            np.testing.assert_array_equal(a[1], b[1])
    assert again.splits["test"].texts("tgt_text") == dm.splits["test"].texts("tgt_text")
    # Changing the data invalidates the cache.
    (tmp_path / "corpus" / "test.de").write_text("anders\n" * 30, encoding="utf-8")
    (tmp_path / "corpus" / "test.en").write_text("other\n" * 30, encoding="utf-8")
    changed = text_datamodule(tmp_path)
    changed.build()
    assert changed.timings["test"][0] == "tokenized" and changed.timings["train"][0] == "loaded from cache"


def test_the_cache_written_in_chunks_holds_each_kept_pair_as_the_tokenizer_encodes_it(tmp_path):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 400)
    for side in ("en", "de"):  # an empty side here and there, and two pairs too long for max_len
        lines = (corpus / f"train.{side}").read_text(encoding="utf-8").split("\n")
        if side == "en":
            lines[5] = lines[77] = ""
        lines[100] = lines[301] = " ".join(["word"] * 80)
        (corpus / f"train.{side}").write_text("\n".join(lines), encoding="utf-8")
    dm = text_datamodule(tmp_path)
    dm.cache.chunk_size = 37  # 11 chunks of the 400 training pairs
    dm.build()
    train = dm.splits["train"]
    assert len(train.src_chunks) == 11
    assert list(train.rows) == [i for i in range(400) if i not in (5, 77, 100, 301)]
    src, tgt = read_text_pair(corpus / "train.en", corpus / "train.de")
    for (src_ids, tgt_ids, index), row in zip(train, train.rows, strict=True):
        assert list(src_ids) == dm.tokenizer.encode([src[row].strip()])[0]
        assert list(tgt_ids) == dm.tokenizer.encode([tgt[row].strip()])[0]
        assert train.src_lens[index] == len(src_ids) and train.tgt_lens[index] == len(tgt_ids)
    test = dm.splits["test"]
    assert test.texts("src_text") == [s.strip() for s in read_text_pair(corpus / "test.en", corpus / "test.de")[0]]


def test_collate_shifts_target_right():
    batch = collate([(np.array([5, 6, 7]), np.array([8, 9]), 4), (np.array([5]), np.array([10, 11, 12]), 1)])
    assert batch["index"].tolist() == [4, 1]
    assert batch["src"].tolist() == [[5, 6, 7, EOS_ID], [5, EOS_ID, PAD_ID, PAD_ID]]
    assert batch["tgt_in"].tolist() == [[BOS_ID, 8, 9, PAD_ID], [BOS_ID, 10, 11, 12]]
    assert batch["tgt_out"].tolist() == [[8, 9, EOS_ID, PAD_ID], [10, 11, 12, EOS_ID]]
    # Counted on the host for training (no device read): what the padded tensors say.
    assert batch["src_lengths"] == batch["src"].ne(PAD_ID).sum(1).tolist() == [4, 2]
    assert batch["tgt_lengths"] == batch["tgt_out"].ne(PAD_ID).sum(1).tolist() == [3, 4]
    assert batch["target_positions"].tolist() == batch["tgt_out"].ne(PAD_ID).flatten().nonzero().flatten().tolist()


def test_the_loss_with_collates_target_positions_is_the_loss_found_on_the_device():
    """sequence_losses projects the rows collate located on the host, or finds them itself: the same
    loss and gradients, bit for bit."""
    rng = np.random.default_rng(0)
    items = [(rng.integers(4, 23, n), rng.integers(4, 23, m), i) for i, (n, m) in enumerate([(5, 2), (3, 7), (6, 6)])]
    batch = collate(items)
    results = []
    for positions in (batch["target_positions"], None):
        torch.manual_seed(0)
        model = Transformer(tiny_config(dropout=0.1))
        torch.manual_seed(1)
        loss, nll, n = sequence_losses(model, batch["src"], batch["tgt_in"], batch["tgt_out"], 0.1, positions)
        loss.backward()
        results.append((loss, nll, n, [p.grad for p in model.parameters()]))
    (loss_a, nll_a, n_a, grads_a), (loss_b, nll_b, n_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(nll_a, nll_b)
    assert int(n_a) == int(n_b) == sum(batch["tgt_lengths"])
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


# ---------------------------------------------------------------- token buckets


def lengths(n=1001, seed=0):
    rng = np.random.default_rng(seed)
    src = rng.integers(1, 60, n)
    return src, np.clip(src + rng.integers(-5, 6, n), 1, None)


def test_batches_respect_max_tokens_and_cover_the_epoch_once():
    src, tgt = lengths()
    sampler = TokenBucketSampler(src, tgt, max_tokens=300, seed=1)
    batches = list(sampler)
    for b in batches:  # padded size per side, counting EOS / BOS
        assert len(b) * (src[b].max() + 1) <= 300 and len(b) * (tgt[b].max() + 1) <= 300
    assert sorted(i for b in batches for i in b) == list(range(len(src)))
    assert padding_efficiency(sampler) > 0.9


def greedy_batches(src, tgt, max_tokens):
    """The batch plan sentence by sentence, as written before it walked lengths (the reference): np.lexsort,
    then each sentence joins the open batch unless the batch's padded size would pass max_tokens."""
    order = np.lexsort((src + tgt, np.maximum(src, tgt)))
    batches, start, widest = [], 0, 0
    for i, (s, t) in enumerate(zip(src[order].tolist(), tgt[order].tolist())):
        if i > start and (i - start + 1) * max(widest, s, t) > max_tokens:
            batches.append(order[start:i].tolist())
            start, widest = i, 0
        widest = max(widest, s, t)
    return batches + [order[start:].tolist()]


@pytest.mark.parametrize("max_tokens", [1, 7, 60, 300, 4096])
def test_the_batch_plan_equals_filling_batches_sentence_by_sentence(max_tokens):
    rng = np.random.default_rng(max_tokens)
    src = rng.integers(1, 80, 5000)
    tgt = np.clip(src + rng.integers(-30, 30, 5000), 1, None)
    sampler = TokenBucketSampler(src, tgt, max_tokens, shuffle=False)
    assert [b.tolist() for b in sampler.all_batches(0)] == greedy_batches(src + 1, tgt + 1, max_tokens)
    big = np.array([70000, 3, 70000, 5])  # keys past 16 bits: the plain lexsort, the same plan
    assert [b.tolist() for b in TokenBucketSampler(big, big, 10**6, shuffle=False).all_batches(0)] == (
        greedy_batches(big + 1, big + 1, 10**6)
    )


def test_a_sentence_longer_than_max_tokens_gets_a_batch_of_its_own():
    batches = list(TokenBucketSampler(np.array([3, 50, 4]), np.array([3, 60, 2]), max_tokens=20))
    assert [1] in batches and sorted(i for b in batches for i in b) == [0, 1, 2]


def test_batch_order_is_reshuffled_per_epoch_from_the_seed():
    src, tgt = lengths()
    a, b = TokenBucketSampler(src, tgt, 300, seed=1), TokenBucketSampler(src, tgt, 300, seed=1)
    epoch0 = list(a)
    assert epoch0 == list(b) == list(a)  # same seed, same epoch: same order, pass after pass
    a.set_epoch(1)
    epoch1 = list(a)
    assert epoch1 != epoch0 and sorted(i for x in epoch1 for i in x) == list(range(len(src)))
    b.set_epoch(1)
    assert list(b) == epoch1
    unshuffled = TokenBucketSampler(src, tgt, 300, shuffle=False)
    assert list(unshuffled) == list(unshuffled)


def test_a_shuffled_epoch_cuts_the_same_batches_and_orders_ties_at_random():
    src = np.full(3000, 9)  # one longer side: the totals alone order the sentences
    tgt = np.r_[np.full(1500, 9), np.full(1500, 8)]  # the last 1,500 (total 19 with EOS/BOS) come first
    cuts = sorted(len(b) for b in greedy_batches(src + 1, tgt + 1, 100))
    whole = TokenBucketSampler(src, tgt, max_tokens=10**6, seed=4)  # one batch: the epoch's order itself
    cut = TokenBucketSampler(src, tgt, max_tokens=100, seed=4)
    positions, orders = np.zeros(3000), set()
    for epoch in range(40):
        (order,) = whole.all_batches(epoch)
        assert sorted(order[:1500].tolist()) == list(range(1500, 3000)) and sorted(order[1500:]) == list(range(1500))
        positions[order] += np.r_[np.arange(1500), np.arange(1500)]
        orders.add(tuple(order[:20].tolist()))
        batches = cut.all_batches(epoch)
        assert sorted(len(b) for b in batches) == cuts  # the same cuts as sentence by sentence
        assert all(len(set((tgt[b]).tolist())) == 1 for b in batches)  # sorted apart before cutting
    assert len(orders) == 40  # every epoch its own order
    # A tie's place is uniform: over 40 epochs each sentence's mean place among its 1,500 ties is
    # 749.5 +- 68 (sd), not its index (a stable sort's order).
    mean = positions / 40
    assert mean.min() > 749.5 - 5 * 68 and mean.max() < 749.5 + 5 * 68
    assert abs(np.corrcoef(np.arange(1500), mean[:1500])[0, 1]) < 0.15


@pytest.mark.parametrize("n", [1001, 1002, 37])
def test_two_ranks_draw_disjoint_equal_shares_of_the_whole_epoch(n):
    src, tgt = lengths(n)
    ranks = [TokenBucketSampler(src, tgt, 300, seed=3, rank=r, world_size=2) for r in range(2)]
    for r in ranks:
        r.set_epoch(5)
    shares = [list(r) for r in ranks]
    assert len(shares[0]) == len(shares[1]) == len(ranks[0])
    flat = [[i for b in share for i in b] for share in shares]
    assert not set(flat[0]) & set(flat[1])
    assert sorted(flat[0] + flat[1]) == list(range(n))


def test_sampler_restored_mid_epoch_yields_exactly_the_remaining_batches():
    src, tgt = lengths()
    sampler = TokenBucketSampler(src, tgt, 300, seed=7)
    sampler.set_epoch(2)
    it = iter(sampler)
    seen = [next(it) for _ in range(5)]
    rest = list(it)
    restored = TokenBucketSampler(src, tgt, 300, seed=7)
    restored.load_state_dict({"epoch": 2, "position": 5, "plan": 2})  # what ResumableLoader saves after 5 batches
    assert list(restored) == rest and len(seen) + len(rest) == len(sampler)
    assert len(list(restored)) == len(sampler)  # the next pass is whole again


def test_a_run_started_with_the_first_batch_plan_keeps_it_when_resumed():
    """Checkpoints saved before plan 2 have no plan in their loader state: their runs continue with plan 1 (a
    shuffle, then two stable sorts: test_compatibility resumes one to the weights the old code reached), even when
    the epoch was planned before the state came (Lightning asks the loader's length first)."""
    src, tgt = lengths()
    old = TokenBucketSampler(src, tgt, 300, seed=7)
    old.set_epoch(2)
    fresh = list(old)
    old.load_state_dict({"epoch": 2, "position": 0})
    assert old.plan == 1 and list(old) != fresh
    rng = np.random.default_rng(7 + 2)  # plan 1 written out: shuffle, stable sorts, cut, shuffle the batches
    order = rng.permutation(len(src))
    order = order[np.lexsort(((src + tgt)[order], np.maximum(src, tgt)[order]))]
    cuts = greedy_batches(src + 1, tgt + 1, 300)
    starts = np.cumsum([0] + [len(b) for b in cuts])
    batches = [order[a:b].tolist() for a, b in zip(starts[:-1], starts[1:])]
    assert list(old) == [batches[i] for i in rng.permutation(len(batches))]


@pytest.mark.parametrize("devices", [1, 2, 7, 8, 32, 64])
def test_the_update_size_is_the_same_on_any_number_of_devices(devices):
    batch_tokens, accumulation = update_shape(25_000, 4096, devices)
    micro_batch = batch_tokens * devices  # one micro-batch on every device
    assert batch_tokens <= 4096 and 25_000 <= accumulation * micro_batch < 25_000 + micro_batch
    assert accumulation == math.ceil(25_000 / (4096 * devices))  # no more micro-batches than max_tokens needs
    # Before, accumulation floored at 1 with 4096 tokens per device: 8 GPUs made 32,768 tokens, 64 made 262,144.


def test_update_shape_by_hand():
    assert update_shape(25_000, 4096, 1) == (3572, 7)  # 7 x 3,572 = 25,004 (was 7 x 4,096 = 28,672)
    assert update_shape(25_000, 3125, 8) == (3125, 1)  # the paper: 8 GPUs
    assert update_shape(25_000, 4096, 64) == (391, 1)  # 64 x 391 = 25,024
    assert update_shape(None, 4096, 8) == (4096, 1)  # no target: max_tokens per device, no accumulation


def test_datamodule_shards_train_batches_by_trainer_rank(tmp_path):
    class FakeTrainer:
        global_rank, world_size = 1, 2
        strategy = SimpleNamespace(root_device=torch.device("cpu"))

    dm = text_datamodule(tmp_path)
    dm.build()
    dm.trainer = FakeTrainer()
    loader = dm.train_dataloader()
    assert loader.batch_sampler.rank == 1 and loader.batch_sampler.world_size == 2
    batch = next(iter(loader))
    assert batch["src"].dtype == torch.long and batch["tgt_in"][:, 0].eq(BOS_ID).all()
    assert dm.update_shape(2) == (dm.max_tokens, 1)


def test_an_unmeasured_auto_batches_with_the_fallback(tmp_path, monkeypatch):
    """data.max_tokens=auto before (or without) the probe, as in ddp_spawn's main process or the data tools:
    data.max_tokens_fallback sizes the batches and the update. The update's shape is worked out once and
    kept for the training sampler, and again when the probe sets max_tokens."""
    worked_out = []
    monkeypatch.setattr(datamodule_module, "update_shape", lambda *a: worked_out.append(a) or update_shape(*a))
    dm = text_datamodule(tmp_path, max_tokens="auto", max_tokens_fallback=40, tokens_per_update=100)
    dm.build()
    assert dm.known_max_tokens() == 40 and dm.update_shape(1) == (34, 3)  # 3 x 34 = 102 tokens
    assert dm.sampler("train", shuffle=False).max_tokens == 34
    assert dm.sampler("validation", shuffle=False).max_tokens == 40
    assert worked_out == [(100, 40, 1)]
    dm.max_tokens = 64  # what the probe found
    assert dm.known_max_tokens() == 64 and dm.update_shape(1) == (50, 2)
    assert dm.sampler("train", shuffle=False).max_tokens == 50
    assert worked_out == [(100, 40, 1), (100, 64, 1)]


@pytest.mark.parametrize(("device", "pinned"), [("cuda", True), ("cuda:3", True), ("cpu", False)])
def test_loaders_pin_their_batches_for_a_gpu(tmp_path, device, pinned):
    """On a GPU the loaders' batches come in page-locked memory (Lightning then copies them without blocking);
    on a CPU, and without a Trainer (the tools), they are not pinned. The Trainer is a stand-in: its device
    type is all the loaders read, and no batch is drawn (that would pin on a machine without CUDA)."""
    dm = text_datamodule(tmp_path)
    dm.build()
    assert not any(loader.pin_memory for loader in (dm.train_dataloader(), dm.val_dataloader()))
    dm.trainer = SimpleNamespace(
        global_rank=0, world_size=1, strategy=SimpleNamespace(root_device=torch.device(device))
    )
    loaders = [dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader(), dm.whole_split_loader("test")]
    assert [loader.pin_memory for loader in loaders] == [pinned] * 4


# ---------------------------------------------------------------- local copies of Hub layouts


def hub_rows(n=40):
    en, de = synthetic_corpus(n, seed=5)
    return [{"de": d, "en": e} for e, d in zip(en, de)]


@pytest.mark.parametrize("layout", ["parquet", "jsonl", "save_to_disk", "flat_columns"])
def test_local_copies_in_the_hubs_layouts(tmp_path, layout):
    rows = {split: hub_rows(40 + i) for i, split in enumerate(["train", "validation", "test"])}
    root = tmp_path / "copy"
    if layout == "save_to_disk":
        datasets.DatasetDict({s: datasets.Dataset.from_dict({"translation": r}) for s, r in rows.items()}).save_to_disk(
            str(root)
        )
    for split, r in rows.items():
        ds = datasets.Dataset.from_dict({"translation": r})
        if layout == "parquet":
            (root / "de-en").mkdir(parents=True, exist_ok=True)
            ds.to_parquet(str(root / "de-en" / f"{split}-00000-of-00001.parquet"))
        elif layout == "jsonl":
            root.mkdir(exist_ok=True)
            ds.to_json(str(root / f"{split}.jsonl"))
        elif layout == "flat_columns":  # Multi30k's Hub schema: one column per language
            root.mkdir(exist_ok=True)
            datasets.Dataset.from_dict({"en": [x["en"] for x in r], "de": [x["de"] for x in r]}).to_parquet(
                str(root / f"{split}-00000-of-00001.parquet")
            )
    corpus = Corpus("wmt14", path=str(root), hub_name="wmt14", hub_config="de-en")
    for split, r in rows.items():
        src, tgt = corpus.load(split).pairs()
        assert src == [x["en"] for x in r] and tgt == [x["de"] for x in r]
    # Direction is a config choice.
    src, tgt = Corpus("wmt14", src_lang="de", tgt_lang="en", path=str(root), hub_config="de-en").load("test").pairs()
    assert src[0] == rows["test"][0]["de"] and tgt[0] == rows["test"][0]["en"]


def test_hub_path_calls_datasets_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(name, config, split):
        calls.append((name, config, split))
        return datasets.Dataset.from_dict({"translation": hub_rows(3)})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    wmt14 = OmegaConf.load(CONF / "data" / "wmt14.yaml")  # where data=wmt14 loads from without data.path
    raw = Corpus("wmt14", hub_name=wmt14.hub_name, hub_config=wmt14.hub_config).load("validation")
    assert calls == [("wmt/wmt14", "de-en", "validation")] and len(raw.pairs()[0]) == 3
    with pytest.raises(ValueError, match="set data.path"):
        Corpus("text").load("train")


MULTI30K_FILES = "train.en, train.de, val.en, val.de, test_2016_flickr.en, test_2016_flickr.de"


@pytest.mark.parametrize(
    "data, fix",
    [
        (
            "multi30k",
            f"Offline, point data.path at a folder with its text files: data.path=<folder with {MULTI30K_FILES}>",
        ),
        (
            "wmt14",
            "Offline, point data.path at a local copy in the Hub's layout: data.path=<folder> (scripts/make_wmt14",
        ),
    ],
)
def test_offline_the_hub_is_asked_once_and_the_error_names_each_data_sets_fix(tmp_path, monkeypatch, data, fix):
    """Without a network, one request to the Hub (no ~25 s of retries), `datasets` then offline (its cache, or an
    error at once), and the one-line error names the fix for this data set: Multi30k's text files, WMT14's layout."""
    asked, loads = [], []

    class NoNetwork:  # huggingface_hub's client on this machine, which cannot resolve huggingface.co
        def head(self, url, **kwargs):
            asked.append(url)
            raise httpx2.ConnectError("[Errno -2] Name or service not known")

    def load_dataset_offline(name, *args, **kwargs):  # what datasets raises offline without a cached copy
        loads.append(datasets.config.HF_HUB_OFFLINE and huggingface_hub.constants.HF_HUB_OFFLINE)
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(huggingface_hub, "get_session", NoNetwork)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset_offline)
    offline_before = datasets.config.HF_HUB_OFFLINE
    cfg = OmegaConf.load(CONF / "data" / f"{data}.yaml")  # where the data set loads from without data.path
    corpus = {key: cfg.get(key) for key in ("hub_name", "hub_config", "text_files")}
    dm = TranslationDataModule(name=data, cache_dir=str(tmp_path / "cache"), **corpus)
    with pytest.raises(MissingInputError) as refused:
        dm.build()
    message = str(refused.value)
    assert asked == [huggingface_hub.constants.ENDPOINT] and loads == [True]  # once each, then the error
    assert offline_before == datasets.config.HF_HUB_OFFLINE  # offline for that load only
    assert "\n" not in message and "(the Hub does not answer: ConnectError: [Errno -2] Name or service" in message
    assert fix in message and (data == "wmt14") == ("make_wmt14_layout" in message)


# ---------------------------------------------------------------- real data (../shared/data)


@pytest.mark.real_data
@pytest.mark.slow
def test_wmt14_code_path_end_to_end_on_a_local_copy(tmp_path):
    script = ROOT / "scripts" / "make_wmt14_layout.py"
    wmt = SHARED_DATA / "wmt14"
    subprocess.run(
        [
            sys.executable,
            str(script),
            "--out",
            str(tmp_path / "wmt14"),
            "--train",
            str(wmt / "train-sample" / "news2008-2012"),
            "--validation",
            str(wmt / "newstest2013"),
            "--test",
            str(wmt / "newstest2014"),
        ],
        check=True,
        capture_output=True,
    )
    dm = TranslationDataModule(
        "wmt14",
        path=str(tmp_path / "wmt14"),
        hub_name="wmt14",
        hub_config="de-en",
        vocab_size=4000,
        max_len=250,
        max_len_ratio=1.5,
        max_tokens=4096,
        cache_dir=str(tmp_path / "cache"),
    )
    dm.build()
    assert len(dm.tokenizer) == 4000
    # newstest2013 / newstest2014, whole: length filters apply to training pairs only
    assert len(dm.splits["validation"]) == 3000 and len(dm.splits["test"]) == 3003
    raw_valid = read_lines(wmt / "newstest2013.de")
    assert len(raw_valid) == 3000 and dm.splits["validation"].texts("tgt_text")[0] == raw_valid[0].strip()
    assert dm.splits["test"].texts("src_text") == [s.strip() for s in read_lines(wmt / "newstest2014.en")]
    assert 12_000 < len(dm.splits["train"]) <= 13_071
    # The same copy read as the Hub is read (data.path unset, data.hub_name = a repository in the Hub's
    # layout): datasets.load_dataset(name, "de-en", split=...) finds the files through the README's configs.
    hub = TranslationDataModule(
        "wmt14",
        hub_name=str(tmp_path / "wmt14"),
        hub_config="de-en",
        vocab_size=4000,
        max_len_ratio=1.5,
        cache_dir=str(tmp_path / "cache-hub"),
    )
    hub.build()
    for split in ("train", "validation", "test"):
        assert len(hub.splits[split]) == len(dm.splits[split])
        assert (hub.splits[split].src_lens == dm.splits[split].src_lens).all()
    batch = next(iter(dm.train_dataloader()))
    assert batch["src"].numel() <= 4096 and batch["tgt_out"].numel() <= 4096
    assert dm.tokenizer.decode(batch["tgt_out"][:1].tolist())[0]  # real German back


@pytest.mark.real_data
@pytest.mark.slow
def test_data_stats_on_multi30k_reports_padding_efficiency_above_90_percent(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "data_stats.py"),
            "data=multi30k",
            f"data.path={SHARED_DATA / 'multi30k'}",
            "data.max_tokens=4096",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]  # no outputs/<date>/<time>/: it trained nothing
    line = next(line for line in out.splitlines() if line.startswith("padding efficiency:"))
    assert float(line.split(":")[1]) >= 0.90, out
    assert "train 29,000" in out and "tokenization: cold" in out and "cached" in out


def test_every_epoch_of_a_lightning_run_sees_every_batch_in_its_own_order(tmp_path):
    class Count(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.train_batches, self.val_batches = {}, []

        def training_step(self, batch, batch_idx):
            self.train_batches.setdefault(self.current_epoch, []).append(batch["index"].tolist())
            return self.weight.sum()

        def validation_step(self, batch, batch_idx):
            self.val_batches.append(batch_idx)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = text_datamodule(tmp_path)
    module = Count()
    trainer = L.Trainer(
        max_epochs=3,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=2,
        enable_model_summary=False,
    )
    trainer.fit(module, dm)
    n_val = len(dm.val_dataloader())
    assert n_val > 2  # so that the sanity check stops the validation loader before its end
    # Epoch e sees exactly the batches of the documented order for seed + e: every one, and a new order each epoch.
    for epoch in range(3):
        assert module.train_batches[epoch] == [b.tolist() for b in dm.train_sampler.all_batches(epoch)], epoch
    assert module.train_batches[0] != module.train_batches[1] != module.train_batches[2]
    # The sanity check's 2 batches, then every validation whole (the abandoned pass does not shorten the next)
    assert module.val_batches == [0, 1] + list(range(n_val)) * 3


@pytest.mark.slow
def test_scale_corpus_generator_is_deterministic_and_read_like_wmt14(tmp_path):
    source = tmp_path / "source"
    en, de = synthetic_corpus(300, seed=3)
    write_pair(source / "train-sample", "news2008-2012", en, de)
    write_pair(source, "newstest2013", en[:20], de[:20])
    write_pair(source, "newstest2014", en[20:40], de[20:40])

    def generate(out: str, pairs: int, seed: int = 0) -> Corpus:
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "make_scale_corpus.py"), "--out", str(tmp_path / out)]
            + ["--pairs", str(pairs), "--shard", "700", "--seed", str(seed), "--source", str(source)],
            check=True,
            capture_output=True,
        )
        return Corpus("wmt14", path=str(tmp_path / out), hub_name="wmt14", hub_config="de-en")

    corpus = generate("a", 2000)
    src, tgt = corpus.load("train").pairs()
    assert len(src) == len(tgt) == 2000 and len(list((tmp_path / "a" / "de-en").glob("train-*"))) == 3
    assert corpus.load("validation").pairs() == (en[:20], de[:20])  # the real newstest files, unchanged
    assert generate("b", 2000).load("train").pairs() == (src, tgt)  # the same seed: the same corpus
    assert generate("c", 2000, seed=1).load("train").pairs() != (src, tgt)
    distinct = [len({w for s in tgt[:n] for w in s.split()}) for n in (200, 2000)]
    assert distinct[1] > distinct[0] > len({w for s in de for w in s.split()})  # new words keep coming


@pytest.mark.real_data
@pytest.mark.slow
def test_scale_report_runs_the_wmt14_pipeline_on_20k_generated_pairs_cold_then_cached(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_scale_corpus.py"), "--out", str(tmp_path / "wmt14")]
        + ["--pairs", "20000", "--shard", "7000"],
        check=True,
        capture_output=True,
    )
    report = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "scale_report.py"), "experiment=base"]
        + [f"data.path={tmp_path / 'wmt14'}", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=8000"]
        + ["data.spm_max_sentences=30000", f"hydra.run.dir={tmp_path / 'run'}"],
        env={**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf")},
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout
    first, second = report.split("first pass")[1].split("second pass")
    for stage in ("datasets: convert the files to Arrow", "SentencePiece: read, sample, train", "train: tokenized"):
        assert stage in first, stage
    for stage in ("SentencePiece: load", "train: loaded from cache", "test: loaded from cache"):
        assert stage in second, stage
    assert "tokenized" not in second and "datasets: convert" not in second
    summary = re.search(r"train ([\d,]+), validation 3,000, test 3,003 pairs kept; ([\d,]+) training tokens", report)
    assert 18_000 < int(summary[1].replace(",", "")) <= 20_000  # ~5% fail the length-ratio filter
    assert re.search(r"vocabulary 8,000; [\d,]+ batches of <= 4,096 tokens per epoch", report)
    for text in (first, second):  # every stage's time and peak memory, and the start-to-first-batch time
        rows = re.findall(r"^  (\S.*?)\s+([\d.]+)\s+([\d.]+)$", text, flags=re.M)
        assert len(rows) >= 7 and all(0 < float(peak) < 4 for _, _, peak in rows), rows
        assert re.search(r"launch to first training batch: [\d.]+ s", text)


# ---------------------------------------------------------------- launched jobs: one data build


def test_other_ranks_wait_for_rank_0s_caches_and_never_build(tmp_path, monkeypatch):
    builder, waiter = text_datamodule(tmp_path), text_datamodule(tmp_path)
    polled = threading.Event()  # the waiting rank has looked and found no cache
    real_ready = waiter.cache.ready

    def ready(raw):
        found = real_ready(raw)
        if not found:
            polled.set()
        return found

    monkeypatch.setattr(waiter.cache, "ready", ready)

    def build_later():  # rank 0, arriving after the other rank has started to wait (an event, not a clock)
        polled.wait()
        builder.build()

    rank_0 = threading.Thread(target=build_later)
    rank_0.start()
    trained = []
    real_train = cache_module.train_tokenizer

    def record(*args, **kwargs):
        trained.append(threading.current_thread() is rank_0)
        return real_train(*args, **kwargs)

    monkeypatch.setattr(cache_module, "train_tokenizer", record)
    waiter.build_when_cached(poll_seconds=0.05, timeout_seconds=3600)  # a hang guard only: rank 0 ends, however slowly
    rank_0.join()
    assert trained == [True]  # SentencePiece trained once, by rank 0
    assert {how for how, _ in waiter.timings.values()} == {"loaded from cache"}
    assert waiter.tokenizer.proto == builder.tokenizer.proto and len(waiter.splits["train"]) == 400
    with pytest.raises(InputError, match="waited .* for rank 0 to write the data caches"):
        text_datamodule(tmp_path / "elsewhere").build_when_cached(poll_seconds=0.01, timeout_seconds=0.03)


def test_a_launched_job_has_one_run_folder_name(monkeypatch):
    for key in ("TORCHELASTIC_RUN_ID", "RANK", "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_JOB_ID", "ENVIRONMENT"):
        monkeypatch.delenv(key, raising=False)
    for key in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(key, raising=False)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", run_folder())  # a plain run: <date>/<time>
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # an salloc shell, not srun: still a plain run
    assert launch_id() is None
    monkeypatch.setenv("ENVIRONMENT", "BATCH")  # sbatch's script running python itself: the job's folder
    assert run_folder() == "slurm-77" and launched_rank() == 0
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert run_folder() == "slurm-77-0" and launched_rank() == 1
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "70")  # a job array's task: the name scontrol requeues
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert run_folder() == "slurm-70_3-0"
    monkeypatch.delenv("SLURM_PROCID")
    monkeypatch.delenv("SLURM_STEP_ID")
    assert run_folder() == "slurm-70_3"
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID")
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    monkeypatch.setenv("RANK", "0")
    assert run_folder() == "torchrun-job42" and launched_rank() == 0


WORKER_SCRIPT = """
import os, time, torch
from torch.utils.data import DataLoader
from transformer_mt.runtime import die_with_parent

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 1000
    def __getitem__(self, i):
        time.sleep(0.01)
        return os.getpid()

loader = DataLoader(Slow(), num_workers=2, worker_init_fn=die_with_parent)  # as the datamodule's loaders
for i, pid in enumerate(loader):
    print(int(pid), flush=True)
    if i == 10:  # the workers fill their prefetch queue, then wait idle, as during a long validation
        print("idle", flush=True)
        time.sleep(60)
"""


# The training process's parent, as the test's stand-in for init: orphaned workers become its children
# (PR_SET_CHILD_SUBREAPER), so their ends are waited for (events, no clock) and read (by which signal).
REAPER = """
import ctypes, os, signal, subprocess, sys
ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
main = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
workers = set()
while (line := main.stdout.readline().strip()) != "idle":
    workers.add(int(line))
def mask(pid, field):
    return next(int(line.split()[1], 16) for line in open(f"/proc/{pid}/status") if line.startswith(field + ":"))
stops = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
for pid in sorted(workers):  # Ctrl+C and a scheduler's SIGTERM reach the whole process group
    os.kill(pid, signal.SIGINT)
    os.kill(pid, signal.SIGTERM)
for pid in sorted(workers):  # an ignored signal is dropped when sent: none pending, the worker still there
    ignored = all(mask(pid, "SigIgn") >> (s - 1) & 1 for s in stops)
    print("ignored" if ignored else "handled", mask(pid, "SigPnd") | mask(pid, "ShdPnd"), main.poll())
main.kill()  # SIGKILL: no finally, no atexit, as the OOM killer or a lost node
main.wait()
for pid in sorted(workers):
    _, status = os.waitpid(pid, 0)  # the worker is this process's child now: its end, as it came
    print("signal" if os.WIFSIGNALED(status) else "exit", os.WTERMSIG(status) if os.WIFSIGNALED(status) else status)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux: PR_SET_PDEATHSIG, a subreaper, /proc")
def test_data_loader_workers_die_with_the_training_process_even_by_sigkill(tmp_path):
    """runtime.die_with_parent: SIGINT and SIGTERM are the training process's to handle (the worker ignores them),
    and a training process killed by SIGKILL takes its workers with it at once, by the kernel's SIGKILL; torch's own
    workers would notice a dead parent later, by a poll, and exit by themselves (status 0), which this tells apart."""
    proc = run_process([sys.executable, "-c", REAPER, WORKER_SCRIPT], tmp_path, timeout=120)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 4, proc.stdout + proc.stderr[-2000:]
    assert lines[:2] == ["ignored 0 None"] * 2, lines  # the stop signals ignored, none pending, the trainer alive
    assert lines[2:] == [f"signal {int(signal.SIGKILL)}"] * 2, lines  # killed by the kernel with their parent


# ---------------------------------------------------------------- damaged and unwritable caches


def test_a_damaged_cache_is_noticed_when_opened_and_built_again_with_a_warning(tmp_path, caplog):
    first = text_datamodule(tmp_path)
    first.build()
    train_cache = first.cache.split_directory(first.raw["train"], first.tokenizer)
    arrow = train_cache / "pairs.arrow"
    expected = [list(first.splits["train"][i][0]) for i in range(5)]
    os.truncate(arrow, arrow.stat().st_size // 2)  # cut short after it was written
    model = first.cache.tokenizer_directory(first.raw["train"]) / "sentencepiece.model"
    model.write_bytes(b"garbage")
    again = text_datamodule(tmp_path)
    with caplog.at_level("WARNING"):
        again.build()
    assert re.search(r"damaged cache, built again: \S+sentencepiece.model: not a SentencePiece model", caplog.text)
    assert re.search(
        rf"damaged cache, built again: {re.escape(str(arrow))} holds [\d,]+ bytes, [\d,]+ were", caplog.text
    )
    assert [list(again.splits["train"][i][0]) for i in range(5)] == expected  # the same ids as before


def test_a_wrong_but_valid_sentencepiece_model_in_a_cache_entry_is_one_line_naming_the_entry(tmp_path):
    """A cache entry records its SentencePiece model's SHA-256 and the settings that made it: another valid model
    there (a vocabulary of 300 in the entry for 400, or the same size with a piece renamed) is refused in one line
    naming the entry and how to build it again, not used to tokenize the splits (issue 45, point 3)."""
    first = text_datamodule(tmp_path)
    first.build()
    entry = first.cache.tokenizer_directory(first.raw["train"])
    record = json.loads((entry / "entry.json").read_text())
    assert record["sha256"] == hashlib.sha256(first.tokenizer.proto).hexdigest() and record["settings"]["vocab"] == 400
    text_datamodule(tmp_path).build()  # the right model: loaded as before
    model, right = entry / "sentencepiece.model", (entry / "sentencepiece.model").read_bytes()
    smaller = text_datamodule(tmp_path / "other", vocab_size=300)
    smaller.build()
    renamed = right.replace(b"\xe2\x96\x81the", b"\xe2\x96\x81thE", 1)  # one piece renamed, the size kept
    assert renamed != right and len(Tokenizer(proto=renamed)) == 400
    for wrong, record_kept in ((smaller.tokenizer.proto, True), (renamed, True), (smaller.tokenizer.proto, False)):
        model.write_bytes(wrong)
        if not record_kept:  # an entry from before the record: its vocabulary size is checked
            (entry / "entry.json").unlink()
        with pytest.raises(InputError) as error:
            text_datamodule(tmp_path).build()
        message = str(error.value)
        assert message.startswith(f"{model}: not the SentencePiece model this cache entry made") and "\n" not in message
        assert message.endswith(f"rm -r {entry} (its tokenized splits follow), or point data.cache_dir elsewhere")
    shutil.rmtree(entry)  # as the line says: trained again, the same model as before
    assert text_datamodule(tmp_path).build() is None and model.read_bytes() == right


def test_a_read_only_cache_ends_in_one_line_naming_the_folder_and_the_fix(tmp_path, monkeypatch):
    # (the tests run as root, whom file modes do not stop: the file system's answer is injected)
    def read_only(target):
        raise OSError(errno.EROFS, "Read-only file system", str(target))

    monkeypatch.setattr(cache_module, "atomic_write", read_only)
    dm = text_datamodule(tmp_path)
    with pytest.raises(InputError, match=r"data.cache_dir=\S+: the data cache cannot be written there \(Read-only"):
        dm.build()


def test_a_full_disk_under_the_cache_ends_in_one_line_naming_the_folder_and_the_fix(tmp_path):
    cache, corpus = tmp_path / "cache", tmp_path / "corpus"
    write_corpus(corpus, 400)
    code = (
        "import resource, signal\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))\n"  # a write past 20 kB fails: a full disk
        "from transformer_mt.data.datamodule import TranslationDataModule\n"
        "from transformer_mt.errors import exit_on_user_error\n"
        f"dm = TranslationDataModule(name='synthetic', path={str(corpus)!r}, text_files={TEXT_FILES!r}, "
        f"vocab_size=400, cache_dir={str(cache)!r})\n"
        "exit_on_user_error(dm.build)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: data.cache_dir={cache}: the data cache cannot be written there (")
    assert "Point data.cache_dir at a writable folder" in lines[0]
    assert not list(cache.glob("*/*.tmp-*")) and not list(cache.glob("*/.*.tmp-*"))  # nothing partial left


def count_tokenizer_trainings(monkeypatch) -> list:
    """Calls of SentencePiece's training through the cache, counted (and refused: a test that reaches it failed)."""
    calls = []
    monkeypatch.setattr(cache_module, "train_tokenizer", lambda *args, **kwargs: calls.append(args) or 1 / 0)
    return calls


def test_a_cache_folder_that_cannot_be_created_is_refused_before_sentencepiece_trains(tmp_path, monkeypatch):
    # (the tests run as root, whom file modes do not stop: a folder under a regular file cannot be made by anyone)
    (tmp_path / "a-file").write_text("not a folder\n")
    trainings = count_tokenizer_trainings(monkeypatch)
    dm = text_datamodule(tmp_path, cache_dir=str(tmp_path / "a-file" / "cache"))
    with pytest.raises(InputError) as refused:
        dm.build()
    message = str(refused.value)
    assert trainings == [] and "\n" not in message
    assert message.startswith(f"data.cache_dir={tmp_path / 'a-file' / 'cache'}: the data cache cannot be written")
    assert "Not a directory" in message and "data.cache_dir=<folder with space>" in message


def test_a_cache_without_room_for_the_estimate_is_refused_before_sentencepiece_trains(tmp_path, monkeypatch):
    trainings = count_tokenizer_trainings(monkeypatch)
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real_usage(path)._replace(free=10_000))  # a full disk
    dm = text_datamodule(tmp_path)
    raw_mib = sum(p.stat().st_size for p in (tmp_path / "corpus").iterdir()) / 2**20
    with pytest.raises(InputError) as refused:
        dm.build()
    message = str(refused.value)
    assert trainings == [] and "\n" not in message
    assert message.startswith(f"data.cache_dir={tmp_path / 'cache'}: the data cache needs about ")
    assert f"1.5x the {raw_mib:,.1f} MiB of raw train/validation/test text, an estimate" in message
    assert "0.0 MiB is free there" in message and "data.cache_dir=<folder with space>" in message
    assert not list((tmp_path / "cache").iterdir())  # the probe file is gone


def test_a_complete_cache_is_only_read_and_needs_no_room(tmp_path, monkeypatch):
    text_datamodule(tmp_path).build()
    trainings = count_tokenizer_trainings(monkeypatch)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: 1 / 0)  # never asked: nothing will be written
    dm = text_datamodule(tmp_path)
    dm.build()
    assert trainings == [] and {how for how, _ in dm.timings.values()} == {"loaded from cache"}
