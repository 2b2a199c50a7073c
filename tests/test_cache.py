"""The SentencePiece model and the tokenized corpus cache: built once, read again, damaged, unwritable (issue: data)."""

import errno
import hashlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading

import numpy as np
import pyarrow as pa
import pytest
import sentencepiece as spm

import transformer_mt.data.cache as cache_module
from conftest import ROOT, run_process, synthetic_corpus, write_corpus
from data_helpers import TEXT_FILES, text_datamodule
from transformer_mt.data.corpus import read_text_pair
from transformer_mt.errors import InputError
from transformer_mt.tokenizer import BOS_ID, EOS_ID, FEW_TEXTS, PAD_ID, UNK_ID, Tokenizer

# ---------------------------------------------------------------- bad input


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
    # Few texts go one by one (FEW_TEXTS), many as SentencePiece's batch: the same ids and texts either way.
    lines = [f"the cat {i} sat ." for i in range(FEW_TEXTS + 5)]
    many = tok.encode(lines)
    assert tok.encode(lines[:3]) == many[:3] == [tok.sp.encode(line) for line in lines[:3]]
    assert tok.decode(many) == lines and tok.decode(many[:3]) == lines[:3]
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
    assert {how for how, _ in dm.cache.timings.values()} == {"tokenized"}
    again = text_datamodule(tmp_path)
    again.build()
    assert {how for how, _ in again.cache.timings.values()} == {"loaded from cache"}
    for split in ("train", "validation", "test"):
        assert len(again.splits[split]) == len(dm.splits[split])
        for a, b in zip(again.splits[split], dm.splits[split], strict=True):
            np.testing.assert_array_equal(a[0], b[0])
            np.testing.assert_array_equal(a[1], b[1])
    assert again.splits["test"].dataset["tgt_text"] == dm.splits["test"].dataset["tgt_text"]
    # Changing the data invalidates the cache.
    (tmp_path / "corpus" / "test.de").write_text("anders\n" * 30, encoding="utf-8")
    (tmp_path / "corpus" / "test.en").write_text("other\n" * 30, encoding="utf-8")
    changed = text_datamodule(tmp_path)
    changed.build()
    assert changed.cache.timings["test"][0] == "tokenized" and changed.cache.timings["train"][0] == "loaded from cache"


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
    assert test.dataset["src_text"] == [s.strip() for s in read_text_pair(corpus / "test.en", corpus / "test.de")[0]]


# ---------------------------------------------------------------- real data (../shared/data)


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
    real_missing = waiter.cache.missing

    def missing(raw):
        found = real_missing(raw)
        if found:
            polled.set()
        return found

    monkeypatch.setattr(waiter.cache, "missing", missing)

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
    waiter.cache.wait_for_rank_0(poll_seconds=0.05, timeout_seconds=3600)  # a hang guard: rank 0 ends, however slowly
    waiter.build()
    rank_0.join()
    assert trained == [True]  # SentencePiece trained once, by rank 0
    assert {how for how, _ in waiter.cache.timings.values()} == {"loaded from cache"}
    assert waiter.tokenizer.proto == builder.tokenizer.proto and len(waiter.splits["train"]) == 400
    with pytest.raises(InputError, match="waited .* for rank 0 to write the data caches"):
        text_datamodule(tmp_path / "elsewhere").cache.wait_for_rank_0(poll_seconds=0.01, timeout_seconds=0.03)


# ---------------------------------------------------------------- damaged and unwritable caches


def test_a_damaged_cache_is_noticed_when_opened_and_built_again_with_a_warning(tmp_path, caplog):
    first = text_datamodule(tmp_path)
    first.build()
    train_cache = first.cache.split_directory(first.raw["train"], first.tokenizer)
    arrow = train_cache / "pairs.arrow"
    expected = [list(first.splits["train"][i][0]) for i in range(5)]
    os.truncate(arrow, arrow.stat().st_size // 2)  # cut short after it was written
    valid_size = first.cache.split_directory(first.raw["validation"], first.tokenizer) / "pairs.sha256"
    valid_size.unlink()  # its size unknown: damaged too
    model = first.cache.tokenizer_directory(first.raw["train"]) / "sentencepiece.model"
    model.write_bytes(b"garbage")
    again = text_datamodule(tmp_path)
    with caplog.at_level("WARNING"):
        again.build()
    assert re.search(r"damaged cache, built again: \S+sentencepiece.model: not a SentencePiece model", caplog.text)
    assert re.search(
        rf"damaged cache, built again: {re.escape(str(arrow))} holds [\d,]+ bytes, [\d,]+ were", caplog.text
    )
    assert re.search(r"damaged cache, built again: \S+pairs.arrow: \[Errno 2\] No such file", caplog.text)
    assert [list(again.splits["train"][i][0]) for i in range(5)] == expected and valid_size.is_file()


def rewrite_ids(arrow, change) -> None:
    """pairs.arrow written again with change(ids) applied to its source ids (int32: the file's size is kept)."""
    table = pa.ipc.open_stream(arrow.read_bytes()).read_all()
    column = table.column("src").combine_chunks()
    ids = pa.array(change(column.values.to_numpy().copy()), pa.int32())
    table = table.set_column(0, "src", pa.ListArray.from_arrays(column.offsets, ids))
    size = arrow.stat().st_size
    with pa.ipc.new_stream(str(arrow), table.schema) as writer:
        writer.write_table(table)
    assert arrow.stat().st_size == size


def test_changed_token_ids_in_a_cache_entry_are_noticed_rebuilt_or_refused_in_one_line(tmp_path, caplog):
    """1,000 ids moved in pairs.arrow, its size kept: its SHA-256 differs, the split is tokenized again (it trained on
    the wrong tokens before, issue 56 point 3); ids past the vocabulary with the record made to match: one line
    naming the entry and the command that rebuilds it (it was a 143-line IndexError at the first batch)."""
    first = text_datamodule(tmp_path)
    first.build()
    entry = first.cache.split_directory(first.raw["train"], first.tokenizer)
    arrow, expected = entry / "pairs.arrow", [list(first.splits["train"][i][0]) for i in range(400)]

    def moved(ids):
        ids[:1000] = (ids[:1000] + 1) % 400
        return ids

    rewrite_ids(arrow, moved)
    with caplog.at_level("WARNING"):
        again = text_datamodule(tmp_path)
        again.build()
    assert f"damaged cache, built again: {arrow}: not the file this cache entry wrote" in caplog.text
    assert [list(again.splits["train"][i][0]) for i in range(400)] == expected

    def past_the_vocabulary(ids):
        ids[7] = 400 + 5
        return ids

    rewrite_ids(arrow, past_the_vocabulary)
    (entry / "pairs.sha256").write_text(f"{hashlib.sha256(arrow.read_bytes()).hexdigest()} {arrow.stat().st_size}\n")
    with pytest.raises(InputError) as error:
        text_datamodule(tmp_path).build()
    message = str(error.value)
    assert message.startswith(f"{arrow}: src token ids from ") and "to 405, outside the vocabulary of 400" in message
    assert message.endswith(f"rm -r {entry}, or point data.cache_dir elsewhere") and "\n" not in message


def test_an_entrys_recorded_settings_must_match_the_model_it_holds(tmp_path):
    """A vocabulary-300 model in the vocabulary-400 entry, its SHA-256 in entry.json updated to match: refused in one
    line naming entry.json (it trained as vocabulary 300 under data.vocab_size=400 before)."""
    first = text_datamodule(tmp_path)
    first.build()
    entry = first.cache.tokenizer_directory(first.raw["train"])
    smaller = text_datamodule(tmp_path / "other", vocab_size=300)
    smaller.build()
    (entry / "sentencepiece.model").write_bytes(smaller.tokenizer.proto)
    record = json.loads((entry / "entry.json").read_text())
    record["sha256"] = hashlib.sha256(smaller.tokenizer.proto).hexdigest()
    (entry / "entry.json").write_text(json.dumps(record))
    with pytest.raises(InputError) as error:
        text_datamodule(tmp_path).build()
    message = str(error.value)
    assert message.startswith(f"{entry / 'entry.json'}: this cache entry holds a 300-word SentencePiece model")
    assert "these settings ask for 400 words" in message and message.endswith("point data.cache_dir elsewhere")


def test_a_wrong_but_valid_sentencepiece_model_in_a_cache_entry_is_one_line_naming_the_entry(tmp_path, caplog):
    """A cache entry records its SentencePiece model's SHA-256: another valid model there (a vocabulary of 300 in the
    entry for 400, or a piece renamed) is refused in one line naming the entry and the fix (issue 45, point 3); an
    entry without its record is damaged, and built again."""
    first = text_datamodule(tmp_path)
    first.build()
    entry = first.cache.tokenizer_directory(first.raw["train"])
    record = json.loads((entry / "entry.json").read_text())
    assert record["sha256"] == hashlib.sha256(first.tokenizer.proto).hexdigest() and record["settings"]["vocab"] == 400
    model, right = entry / "sentencepiece.model", (entry / "sentencepiece.model").read_bytes()
    smaller = text_datamodule(tmp_path / "other", vocab_size=300)
    smaller.build()
    renamed = right.replace(b"\xe2\x96\x81the", b"\xe2\x96\x81thE", 1)  # one piece renamed, the size kept
    assert renamed != right and len(Tokenizer(proto=renamed)) == 400
    for wrong in (smaller.tokenizer.proto, renamed):
        model.write_bytes(wrong)
        with pytest.raises(InputError) as error:
            text_datamodule(tmp_path).build()
        message = str(error.value)
        assert message.startswith(f"{model}: not the SentencePiece model this cache entry made") and "\n" not in message
        assert message.endswith(f"rm -r {entry} (its tokenized splits follow), or point data.cache_dir elsewhere")
    (entry / "entry.json").unlink()
    with caplog.at_level("WARNING"):
        text_datamodule(tmp_path).build()  # trained again: the same model as before
    assert "damaged cache, built again" in caplog.text and model.read_bytes() == right


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
    proc = run_process([sys.executable, "-c", code], tmp_path)
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
    assert "0.0 MiB free there" in message and "data.cache_dir=<folder with space>" in message
    assert not list((tmp_path / "cache").iterdir())  # the probe file is gone


def test_a_complete_cache_is_only_read_and_needs_no_room(tmp_path, monkeypatch):
    text_datamodule(tmp_path).build()
    trainings = count_tokenizer_trainings(monkeypatch)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: 1 / 0)  # never asked: nothing will be written
    dm = text_datamodule(tmp_path)
    dm.build()
    assert trainings == [] and {how for how, _ in dm.cache.timings.values()} == {"loaded from cache"}
