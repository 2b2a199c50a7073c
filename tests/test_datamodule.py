"""The LightningDataModule: settings, lengths, loaders, a Lightning run's epochs and launched jobs (issue: data)."""

import re
import signal
import sys
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

from conftest import quiet_trainer, run_process, write_corpus
from data_helpers import text_datamodule
from transformer_mt.commandline import check_command_line
from transformer_mt.configs import run_folder
from transformer_mt.errors import InputError
from transformer_mt.launcher import launch_id, launched_rank
from transformer_mt.tokenizer import BOS_ID

# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "key, value",
    [
        ("max_tokens", -5),
        ("max_tokens", 0),
        ("max_tokens", "most"),
        ("max_tokens_fallback", 0),
        ("vocab_size", 0),
        ("max_len", -1),
        ("tokens_per_update", 0),
    ],
)
def test_impossible_batch_settings_are_refused(tmp_path, key, value):
    with pytest.raises(InputError, match=rf"data\.{key}={value}: "):
        text_datamodule(tmp_path, **{key: value})


def test_a_data_setting_of_the_wrong_type_is_refused_as_the_command_line_is_read():
    with pytest.raises(InputError, match=r"data\.max_tokens_fallback=auto: must be a whole number"):
        check_command_line("train", ["data.max_tokens_fallback=auto"])


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


# ---------------------------------------------------------------- the loaders: ranks, the update's shape, pinned memory


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


def test_an_unmeasured_auto_batches_with_the_fallback(tmp_path):
    """data.max_tokens=auto before (or without) the probe, as in ddp_spawn's main process or the data tools:
    data.max_tokens_fallback sizes the batches and the update, until the probe sets max_tokens."""
    dm = text_datamodule(tmp_path, max_tokens="auto", max_tokens_fallback=40, tokens_per_update=100)
    dm.build()
    assert dm.known_max_tokens() == 40 and dm.update_shape(1) == (34, 3)  # 3 x 34 = 102 tokens
    assert dm.sampler("train", shuffle=False).max_tokens == 34
    assert dm.sampler("validation", shuffle=False).max_tokens == 40
    dm.max_tokens = 64  # what the probe found
    assert dm.known_max_tokens() == 64 and dm.update_shape(1) == (50, 2)
    assert dm.sampler("train", shuffle=False).max_tokens == 50


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
    loaders = [dm.train_dataloader(), dm.val_dataloader(), dm.loader("test")]
    assert [loader.pin_memory for loader in loaders] == [pinned] * 3


# ---------------------------------------------------------------- a Lightning run's epochs


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
    trainer = quiet_trainer(max_epochs=3, use_distributed_sampler=False, num_sanity_val_steps=2)
    trainer.fit(module, dm)
    n_val = len(dm.val_dataloader())
    assert n_val > 2  # so that the sanity check stops the validation loader before its end
    # Epoch e sees exactly the batches of the documented order for seed + e: every one, and a new order each epoch.
    for epoch in range(3):
        assert module.train_batches[epoch] == [b.tolist() for b in dm.train_sampler.all_batches(epoch)], epoch
    assert module.train_batches[0] != module.train_batches[1] != module.train_batches[2]
    # The sanity check's 2 batches, then every validation whole (the abandoned pass does not shorten the next)
    assert module.val_batches == [0, 1] + list(range(n_val)) * 3


# ---------------------------------------------------------------- launched jobs: one run folder; loader workers


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
from transformer_mt.stops import die_with_parent

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
    """stops.die_with_parent: SIGINT and SIGTERM are the training process's to handle (the worker ignores them),
    and a training process killed by SIGKILL takes its workers with it at once, by the kernel's SIGKILL; torch's own
    workers would notice a dead parent later, by a poll, and exit by themselves (status 0), which this tells apart."""
    proc = run_process([sys.executable, "-c", REAPER, WORKER_SCRIPT], tmp_path)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 4, proc.stdout + proc.stderr[-2000:]
    assert lines[:2] == ["ignored 0 None"] * 2, lines  # the stop signals ignored, none pending, the trainer alive
    assert lines[2:] == [f"signal {int(signal.SIGKILL)}"] * 2, lines  # killed by the kernel with their parent
