"""Counting the places where the host waits for the device, on a CPU: a GPU pays for each one (the queue of
kernels drains before the host goes on), a CPU does not, so a CPU test has to count them.

They are the reads of a tensor's values (item, float, bool, tolist, numpy) and the ops whose output size
depends on values (nonzero, a boolean mask's index, masked_select, unique). The CUDA tier checks the same
rule with torch.cuda.set_sync_debug_mode (tests/test_cuda.py)."""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path

import lightning as L
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

from transformer_mt.data.batching import collate
from transformer_mt.runtime import end_process_group
from transformer_mt.training.callbacks import ProgressLog, RunEnd, UpdateProgressBar
from transformer_mt.training.module import TranslationModule

MODEL = dict(vocab_size=20, d_model=16, d_ff=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, dropout=0.1)

SIZE_FROM_VALUES = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "_unique2", "unique_dim"}


class DeviceWaits(TorchDispatchMode):
    """Inside the block: every wait, with the line of this project's code (src/ or tests/) that caused it."""

    def __init__(self):
        super().__init__()
        self.waits: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        masks = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
        )
        if name in SIZE_FROM_VALUES or masks:
            self.note(name)
        return func(*args, **(kwargs or {}))

    def note(self, what: str) -> None:
        ours = ("/transformer_mt/", "/tests/")
        frames = [f for f in traceback.extract_stack()[:-2] if any(part in f.filename for part in ours)]
        last = frames[-1] if frames else None
        where = f"{last.filename.split('/')[-1]}:{last.lineno} ({last.name})" if last else "lightning/torch"
        self.waits.append(f"{what} at {where}")

    def __enter__(self):
        # tolist() and numpy() read a CPU tensor's memory without an op the mode sees: counted by hand.
        self._patched = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, self._counting(name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def _counting(self, name, original):
        def read(tensor, *args, **kwargs):
            self.note(name)
            return original(tensor, *args, **kwargs)

        return read


class CudaWaits:
    """The same count on a GPU, from CUDA itself: torch.cuda.set_sync_debug_mode warns at every operation
    that synchronises with the device; inside the block, `waits` lists them."""

    def __enter__(self):
        self._warnings = warnings.catch_warnings(record=True)
        self._record = self._warnings.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        return self._warnings.__exit__(*exc)

    @property
    def waits(self) -> list[str]:
        return [str(w.message).splitlines()[0] for w in self._record if "synchroniz" in str(w.message)]


class WaitsPerMicroBatch(L.Callback):
    """The waits of each training micro-batch (its step, backward and, for the last of an update, the
    optimizer step and every callback's batch end), and whether it ended an update."""

    def __init__(self, counter: DeviceWaits):
        self.counter, self.batches = counter, []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.start, self.step = len(self.counter.waits), trainer.global_step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.batches.append((trainer.global_step != self.step, self.counter.waits[self.start :]))


def micro_batches(seed: int = 0) -> list[dict]:
    """6 micro-batches (2 updates of 3 at accumulate_grad_batches=3) of random sentences, targets 1 longer."""
    g, batches, index = torch.Generator().manual_seed(seed), [], 0
    for lengths in [[5, 3], [2, 7, 4], [6], [3, 3], [4, 2, 8], [5]]:
        items = []
        for n in lengths:
            src, tgt = (torch.randint(4, MODEL["vocab_size"], (m,), generator=g).numpy() for m in (n, n + 1))
            items.append((src, tgt, index))
            index += 1
        batches.append(collate(items))
    return batches


def count_waits(
    batches: list[dict], run_dir: Path, counter: DeviceWaits | CudaWaits | None = None, **trainer_args
) -> tuple[TranslationModule, list]:
    """Trains on the batches (2 updates) with the shipped callbacks: the module, and each micro-batch's
    (ended an update, waits)."""
    counter = counter or DeviceWaits()
    waits = WaitsPerMicroBatch(counter)
    callbacks = [RunEnd(run_dir, keep_last=1), ProgressLog(every=1000), UpdateProgressBar(), waits]
    trainer = L.Trainer(
        max_steps=2,
        accumulate_grad_batches=3,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=callbacks,
        **{"accelerator": "cpu", **trainer_args},
    )
    module = TranslationModule(MODEL, val_bleu_sentences=0)
    with counter:
        trainer.fit(module, DataLoader(batches, batch_size=None))
    return module, waits.batches


if __name__ == "__main__":  # under torchrun: Lightning's DDP; this rank's waits go to <out>-<rank>.json
    out, rank = sys.argv[1], int(os.environ["RANK"])
    devices = int(os.environ["WORLD_SIZE"])
    module, found = count_waits(micro_batches(seed=rank), Path(out).parent, devices=devices, strategy="ddp")
    Path(f"{out}-{rank}.json").write_text(json.dumps(found))
    del module  # and the Trainer it holds: the process group goes with them (runtime.end_process_group)
    assert not (still_running := end_process_group()), f"the process group outlived the Trainer: {still_running}"
