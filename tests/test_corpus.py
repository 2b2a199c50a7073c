"""Reading and cleaning corpora: text pairs, bad input, Corpus and local copies of the Hub's layouts (issue: data)."""

import subprocess
import sys

import datasets
import httpx2
import huggingface_hub
import numpy as np
import pytest
from omegaconf import OmegaConf

from conftest import CONF, ROOT, SHARED_DATA, synthetic_corpus, write_pair
from data_helpers import TEXT_FILES
from transformer_mt.configs import compose
from transformer_mt.data.corpus import Corpus, drop_empty, length_filter, read_text_pair
from transformer_mt.data.datamodule import TranslationDataModule
from transformer_mt.errors import MissingInputError
from transformer_mt.files import read_lines

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


def test_a_corpus_takes_its_fields_from_a_data_config_and_leaves_the_rest(tmp_path):
    """Corpus.from_config picks the Corpus fields of a composed data config (conf/data/multi30k.yaml on
    default.yaml); the config's other keys (vocabulary, batching, cache) are the DataModule's and are passed
    over. An override wins; one that is no field is refused, as the DataModule refuses an unknown setting."""
    data = OmegaConf.to_container(compose("train", ["data=multi30k"]).data, resolve=True)
    assert {"vocab_size", "max_tokens", "cache_dir"} <= set(data)  # not Corpus fields
    corpus = Corpus.from_config(data)
    assert corpus == Corpus(
        "multi30k",
        "en",
        "de",
        hub_name="bentrevett/multi30k",
        text_files={"train": "train", "validation": "val", "test": "test_2016_flickr"},
    )
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


# ---------------------------------------------------------------- cleaning


def test_drop_empty_strips_and_counts():
    src, tgt, rows = drop_empty([" a ", "", "b", "c"], ["x", "y", "  ", " z\r"])
    assert (src, tgt, rows) == (["a", "c"], ["x", "z"], [0, 3])


def test_length_filter_counts_each_rule():
    src, tgt = np.array([3, 10, 4, 2, 6]), np.array([3, 4, 12, 7, 5])
    keep, drops = length_filter(src, tgt, max_len=10, max_ratio=2.0)
    assert keep.tolist() == [True, False, False, False, True]
    assert drops == {"longer than 10 tokens": 1, "length ratio above 2.0": 2}


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
    splits = ["--train", wmt / "train-sample" / "news2008-2012", "--validation", wmt / "newstest2013"]
    args = ["--out", tmp_path / "wmt14", *splits, "--test", wmt / "newstest2014"]
    subprocess.run([sys.executable, str(script), *map(str, args)], check=True, capture_output=True)
    settings = dict(hub_config="de-en", vocab_size=4000, max_len_ratio=1.5)
    dm = TranslationDataModule(
        "wmt14", path=str(tmp_path / "wmt14"), hub_name="wmt14", cache_dir=str(tmp_path / "cache"), **settings
    )
    dm.build()
    assert len(dm.tokenizer) == 4000
    # newstest2013 / newstest2014, whole: length filters apply to training pairs only
    assert len(dm.splits["validation"]) == 3000 and len(dm.splits["test"]) == 3003
    raw_valid = read_lines(wmt / "newstest2013.de")
    assert len(raw_valid) == 3000 and dm.splits["validation"].dataset["tgt_text"][0] == raw_valid[0].strip()
    assert dm.splits["test"].dataset["src_text"] == [s.strip() for s in read_lines(wmt / "newstest2014.en")]
    assert 12_000 < len(dm.splits["train"]) <= 13_071
    # The same copy read as the Hub is read (data.path unset, data.hub_name = a repository in the Hub's
    # layout): datasets.load_dataset(name, "de-en", split=...) finds the files through the README's configs.
    hub = TranslationDataModule("wmt14", hub_name=str(tmp_path / "wmt14"), cache_dir=str(tmp_path / "hub"), **settings)
    hub.build()
    for split in ("train", "validation", "test"):
        assert len(hub.splits[split]) == len(dm.splits[split])
        assert (hub.splits[split].src_lens == dm.splits[split].src_lens).all()
    batch = next(iter(dm.train_dataloader()))
    assert batch["src"].numel() <= 4096 and batch["tgt_out"].numel() <= 4096
    assert dm.tokenizer.decode(batch["tgt_out"][:1].tolist())[0]  # real German back


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
