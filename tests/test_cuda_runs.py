"""The GPU through the entry points, as a user runs them: Multi30k training (the loss falls, val BLEU), beam search
on the GPU against the CPU (its checkpoint, and random weights), DDP and FSDP on two ranks (two GPUs over NCCL, or
both ranks on a machine's one GPU over gloo), then translate. Skipped without a CUDA GPU; `make gpu-check` runs
them. Multi30k's text files: $TRANSFORMER_MT_MULTI30K, else ../shared/data/multi30k beside the checkout (not the
Hub: these machines are offline), else a made-up corpus in their layout: nothing here needs more than the repository."""

import copy
import csv
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import ROOT, free_port, run_process
from test_cuda_trainer import MULTI30K_LAYOUT, made_up_corpus
from transformer_mt.checkpoint import load_for_inference
from transformer_mt.configs import model_preset
from transformer_mt.files import read_lines
from transformer_mt.model import Transformer, TransformerConfig
from transformer_mt.runtime import use_tf32
from transformer_mt.search import translate_ids

pytestmark = pytest.mark.cuda

MULTI30K_ENV = "TRANSFORMER_MT_MULTI30K"  # scripts/gpu_check.py --multi30k DIR sets it
SHARED_MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
UPDATES = 150  # of the Multi30k run, a validation at the end
SENTENCES = [  # the DDP and FSDP checkpoints translate these
    "A man in a blue shirt is standing on a ladder.",
    "Two dogs are playing in the snow.",
    "A group of people are sitting at a table in a restaurant.",
    "A little girl climbs into a wooden playhouse.",
    "The woman is riding a bicycle down the street.",
]
# Two ranks on one GPU: NCCL refuses two ranks on one device, so they talk over gloo, which takes CUDA tensors too
# (through the host). Lightning takes the backend from the strategy's constructor (process_group_backend), which
# the trainer configs do not set: this runs the training entry point with the default of the strategies it builds
# (DDPStrategy, and trainer=fsdp's LayerFSDP, FSDP2 on DDPStrategy's constructor) switched to gloo; a backend given
# explicitly still wins.
GLOO_TRAIN = """\
import runpy
from functools import partialmethod
from lightning.pytorch.strategies import DDPStrategy
DDPStrategy.__init__ = partialmethod(DDPStrategy.__init__, process_group_backend="gloo")
runpy.run_module("transformer_mt.train", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(scope="module")
def multi30k(tmp_path_factory) -> Path:
    """Multi30k's text files: $TRANSFORMER_MT_MULTI30K (an error if it has none), else ../shared/data/multi30k, else
    a made-up corpus in their layout and size (29,000 training pairs of ~12 words, translated word for word), so
    that a GPU machine given the repository alone runs every test here."""
    given = os.environ.get(MULTI30K_ENV)
    if given:
        if not (Path(given) / "train.en").is_file():
            pytest.fail(f"${MULTI30K_ENV}={given}: no Multi30k text files (train.en, val.en, test_2016_flickr.en, ...)")
        return Path(given).resolve()
    if (SHARED_MULTI30K / "train.en").is_file():
        return SHARED_MULTI30K.resolve()
    root = tmp_path_factory.mktemp("made-up-multi30k")
    return made_up_corpus(root, 29_000, words=10_000, held_out=1000, longest=40, median=12, layout=MULTI30K_LAYOUT)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """The SentencePiece model and encoded data, built once for all of this module's runs."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def highest_fp32_matmuls():
    """fp32 comparisons mean fp32 products: no TF32 (PyTorch's default, set here in case a user changed it)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def run(command: list[str], timeout: float, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    """A command as a user runs it; a failure fails the test with its last error line, after its output's tail."""
    shown = " ".join(["python", *command[1:]])
    print(f"$ {shown}", flush=True)
    try:
        proc = subprocess.run(
            command,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(command[1:3])} did not finish within {timeout:.0f} s")
    if proc.returncode != 0:
        print("\n".join((proc.stdout + proc.stderr).rstrip().splitlines()[-30:]))
        last = next((line for line in reversed(proc.stderr.splitlines()) if line.strip()), "")
        pytest.fail(f"{' '.join(command[1:3])}: exit status {proc.returncode}: {last.strip()[:160]}")
    return proc


def train_command(run_dir: Path, multi30k: Path, cache_dir: Path, *overrides: str) -> list[str]:
    """The Multi30k recipe through the training entry point (overrides choose the trainer)."""
    return [
        sys.executable,
        "-m",
        "transformer_mt.train",
        "experiment=multi30k",
        "logger=csv",  # the experiment logs to wandb; metrics.csv is written either way
        "final.enabled=false",  # no test decoding: the device time is short
        "trainer.enable_progress_bar=false",
        f"data.path={multi30k}",
        f"data.cache_dir={cache_dir}",
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]


def train(run_dir: Path, multi30k: Path, cache_dir: Path, *overrides: str, timeout: float) -> Path:
    """train_command run as a user runs it; its checkpoint."""
    run(train_command(run_dir, multi30k, cache_dir, *overrides), timeout, cwd=run_dir.parent)
    return run_dir / "checkpoints" / "last.ckpt"


def two_rank_launch(command: list[str], strategy: str, gpus: int, port: int) -> list[tuple[list[str], dict]]:
    """The processes of a two-rank run of the training `command` (python -m transformer_mt.train ...): (command,
    environment added) for each. With 2 or more GPUs, one process on every GPU: Lightning starts the other ranks
    itself, over NCCL. With one GPU, two processes started at once as two one-GPU nodes of Lightning's own cluster
    environment (LOCAL_RANK 0 on both: each rank's device is cuda:0; NODE_RANK and RANK its rank, which the entry
    point reads too: rank 1 waits for rank 0's data caches), over gloo (GLOO_TRAIN)."""
    if gpus >= 2:
        return [([*command, f"trainer={strategy}", f"trainer.devices={gpus}"], {})]
    entry = command.index("transformer_mt.train")
    overrides = [*command[entry + 1 :], f"trainer={strategy}", "trainer.devices=1", "trainer.num_nodes=2"]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_RANK": "0"}
    return [([command[0], "-c", GLOO_TRAIN, *overrides], {**env, "NODE_RANK": str(r), "RANK": str(r)}) for r in (0, 1)]


def run_ranks(launch: list[tuple[list[str], dict]], cwd: Path, timeout: float) -> None:
    """Every process of a launch at once (conftest.run_process: each in a session of its own, killed at the
    timeout); a failure of any fails the test with the tail of its output."""
    with ThreadPoolExecutor(len(launch)) as pool:
        procs = list(pool.map(lambda process: run_process(process[0], cwd, process[1], timeout=timeout), launch))
    for rank, proc in enumerate(procs):
        if proc.returncode != 0:
            print("\n".join((proc.stdout + proc.stderr).rstrip().splitlines()[-30:]))
            last = next((line for line in reversed(proc.stderr.splitlines()) if line.strip()), "")
            pytest.fail(f"process {rank} of {len(procs)}: exit status {proc.returncode}: {last.strip()[:160]}")


def logged(run_dir: Path, metric: str) -> list[float]:
    """Every logged value of one metric, in order, from the CSV logger's metrics.csv."""
    with open(run_dir / "csv" / "version_0" / "metrics.csv", newline="") as f:
        return [float(row[metric]) for row in csv.DictReader(f) if row.get(metric)]


@pytest.fixture(scope="module")
def multi30k_run(multi30k, cache_dir, tmp_path_factory) -> Path:
    """UPDATES updates of `experiment=multi30k trainer=gpu` (bf16), one validation at the end: the run folder."""
    run_dir = tmp_path_factory.mktemp("multi30k")
    train(
        run_dir,
        multi30k,
        cache_dir,
        "trainer=gpu",
        f"trainer.max_steps={UPDATES}",
        f"trainer.log_every_n_steps={UPDATES // 20}",
        f"trainer.val_check_interval={UPDATES}",  # one validation, at the end
        f"progress_every_n_updates={UPDATES // 4}",
        timeout=420,
    )
    return run_dir


@pytest.mark.timeout(600)
def test_multi30k_training_on_the_gpu_lowers_the_loss(multi30k_run, record_property):
    losses = logged(multi30k_run, "train/loss")
    assert len(losses) >= 4, f"only {len(losses)} training losses in {multi30k_run}/csv/version_0/metrics.csv"
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2  # two logged steps each: batches differ in length
    bleu = logged(multi30k_run, "val/bleu")
    speed = logged(multi30k_run, "train/tgt_tok_per_s")
    figures = (
        f"loss {first:.2f} -> {last:.2f} in {UPDATES} updates"
        + (f", val BLEU {bleu[-1]:.1f}" if bleu else ", no val/bleu")
        + (f", {statistics.median(speed):,.0f} tgt tok/s" if speed else "")
    )
    record_property("figures", figures)
    assert last < 0.85 * first, f"{figures} (expected at least 15% lower)"
    assert bleu, f"{figures}: the validation at update {UPDATES} logged no val/bleu"
    assert (multi30k_run / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("weights", ["multi30k", "random"])
def test_beam_search_on_the_gpu_gives_the_cpus_tokens(weights, request, highest_fp32_matmuls, record_property):
    n = 100
    if weights == "multi30k":  # the trained run's checkpoint on real sentences
        model, tokenizer, _ = load_for_inference(request.getfixturevalue("multi30k_run") / "checkpoints" / "last.ckpt")
        test_file = request.getfixturevalue("multi30k") / "test_2016_flickr.en"
        sources = tokenizer.encode(read_lines(test_file)[:n])
    else:  # the small preset's random weights on random ids
        torch.manual_seed(0)
        model = Transformer(TransformerConfig(vocab_size=5000, **model_preset("small"))).eval()
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(3, 30, (n,), generator=g).tolist()
        sources = [torch.randint(4, model.cfg.vocab_size, (k,), generator=g).tolist() for k in lengths]
    sources = [ids[: model.cfg.max_positions - 1] for ids in sources]
    decode = lambda model: translate_ids(model, sources, beam_size=4)  # noqa: E731 (the paper's alpha)
    on_cpu = decode(model.float().cpu())
    on_gpu = decode(copy.deepcopy(model).cuda())
    differ = [i for i, (a, b) in enumerate(zip(on_cpu, on_gpu)) if a != b]
    for i in differ[:3]:
        print(f"sentence {i}: cpu {on_cpu[i][:20]} / cuda {on_gpu[i][:20]}")
    figures = f"{len(sources) - len(differ)}/{len(sources)} identical (beam 4, fp32, {weights} weights)"
    record_property("figures", figures)
    # fp32 sums run in another order on the GPU: a near-tie between two hypotheses may rarely flip
    assert len(differ) <= 0.02 * len(sources), figures


def test_decoding_in_tf32_gives_the_fp32_translations(multi30k_run, multi30k, highest_fp32_matmuls, record_property):
    """make evaluate / translate and the end of a run decode on a GPU with TF32 products (use_tf32): the
    trained model's beam-4 translations of Multi30k's test sentences are fp32's on at least 98% of them."""
    model, tokenizer, _ = load_for_inference(multi30k_run / "checkpoints" / "last.ckpt")
    sources = [
        ids[: model.cfg.max_positions - 1] for ids in tokenizer.encode(read_lines(multi30k / "test_2016_flickr.en"))
    ]
    decode = lambda model: translate_ids(model, sources, beam_size=4)  # noqa: E731 (the paper's alpha)
    model.cuda()
    start = time.perf_counter()
    fp32 = decode(model)
    fp32_seconds = time.perf_counter() - start
    use_tf32()
    start = time.perf_counter()
    tf32 = decode(model)
    tf32_seconds = time.perf_counter() - start
    same = sum(a == b for a, b in zip(fp32, tf32))
    figures = (
        f"{same}/{len(sources)} identical (beam 4, TF32 vs fp32); {len(sources) / tf32_seconds:.0f} vs "
        f"{len(sources) / fp32_seconds:.0f} sent/s"
    )
    record_property("figures", figures)
    assert same >= 0.98 * len(sources), figures


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_rank_training_then_translate(strategy, multi30k, cache_dir, tmp_path, record_property):
    updates, gpus = 20, torch.cuda.device_count()
    run_dir = tmp_path / strategy
    command = train_command(
        run_dir,
        multi30k,
        cache_dir,
        f"trainer.max_steps={updates}",
        f"trainer.val_check_interval={updates}",  # one validation (greedy decoding under the strategy), at the end
        "val_bleu_sentences=100",
    )
    launch = two_rank_launch(command, strategy, gpus, free_port())
    print("$ " + " ".join(["python", *launch[0][0][1:]]).replace(GLOO_TRAIN, "<GLOO_TRAIN>"), flush=True)
    run_ranks(launch, cwd=tmp_path, timeout=300)
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    # Greedy: 20 updates leave a model close to its random start, whose outputs are long strings of pieces; beam
    # search may rank an immediate EOS first for some inputs (an empty line).
    translate = [
        sys.executable,
        "-m",
        "transformer_mt.translate",
        f"ckpt={checkpoint}",
        "device=cuda",
        "decoding=greedy",
    ]
    proc = run(translate, timeout=180, cwd=tmp_path, stdin="\n".join(SENTENCES) + "\n")
    lines = proc.stdout.split("\n")[:-1]
    for source, line in zip(SENTENCES, lines):
        print(f"{source} -> {line[:100]}")
    answered = sum(map(bool, lines))
    ranks = f"{gpus} GPUs over NCCL" if gpus >= 2 else "2 ranks on 1 GPU over gloo"
    figures = f"{strategy}: {updates} updates on {ranks}; {answered}/{len(SENTENCES)} lines non-empty"
    record_property("figures", figures)
    # One output line per input line; after 20 updates a model may still answer some with an empty line.
    assert len(lines) == len(SENTENCES), f"{figures} ({len(lines)} lines)"
