"""Counting the places where the host waits for the device, on a CPU: a GPU pays for each one (the queue of
kernels drains before the host goes on), a CPU does not, so a CPU test has to count them.

They are the reads of a tensor's values (item, float, bool, tolist, numpy), the ops whose output size
depends on values (nonzero, a boolean mask's index, masked_select, unique), and device tensors built from
Python values (torch.tensor(x, device=...): a pageable copy, then a synchronisation; Lightning's
self.log(float) does it). The count covers a whole run, whatever part of the loop causes a wait: each wait
is filed under the update in progress (from a micro-batch's start to the next one's), or under start-up,
the end, a checkpoint write or a validation. The CUDA tier counts the same with
torch.cuda.set_sync_debug_mode (CudaWaits)."""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

import lightning as L
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import transformer_mt.training.fit as entry

# A real run's whole cycle: accumulation (2 micro-batches per update), validations, periodic and time-based
# checkpoints, the moving average, progress lines and bar, and the loggers written at every update (their worst case).
WAITS_RUN = [
    "data.tokens_per_update=600",
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=true",
    "checkpoint.every_n_train_steps=2",
    "checkpoint.train_time_interval_minutes=1e-6",
    "progress_every_n_updates=2",
    "ema_decay=0.99",
]


CHECKPOINT_WRITES = {"save_checkpoint", "dump_checkpoint"}  # and everything ModelCheckpoint does to choose a file
SIZE_FROM_VALUES = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "_unique2", "unique_dim"}


class Waits:
    """The waits seen inside the block, each as {phase, kind, what, where}: phase the update in progress
    (1, 2, ...; set by UpdatePhases), "start-up" or "end"; kind "update", "checkpoint" (under a checkpoint
    write), "validation" or "data loading" (a DataLoader's host tensors, at an epoch's start); where the last
    line of this project's code (src/ or tests/) on the stack."""

    def __init__(self):
        super().__init__()
        self.found: list[dict] = []
        self.phase: int | str = "start-up"

    def note(self, what: str) -> None:
        stack = list(reversed(traceback.StackSummary.extract(traceback.walk_stack(None), lookup_lines=False)))[:-2]
        if any(f.name in CHECKPOINT_WRITES or f.filename.endswith("model_checkpoint.py") for f in stack):
            kind = "checkpoint"
        elif any(f.filename.endswith("evaluation_loop.py") for f in stack):
            kind = "validation"
        elif any("/torch/utils/data/" in f.filename for f in stack):  # a new epoch's loader: its seed, on the host
            kind = "data loading"
        else:
            kind = "update"
        ours = [f for f in stack if "/transformer_mt/" in f.filename or "/tests/" in f.filename]
        last = ours[-1] if ours else stack[-1]
        inner = next((f for f in reversed(stack) if "/torch/" not in f.filename), stack[-1])
        where = f"{last.filename.split('/')[-1]}:{last.lineno} ({last.name})"
        if inner is not last:  # inside a library: its line too
            where += f" -> {'/'.join(inner.filename.split('/')[-2:])}:{inner.lineno} ({inner.name})"
        self.found.append({"phase": self.phase, "kind": kind, "what": what, "where": where})

    def per_update(self) -> dict[int, list[str]]:
        """The waits of each update that are not a checkpoint's or a validation's."""
        updates: dict[int, list[str]] = {}
        for wait in self.found:
            if isinstance(wait["phase"], int):
                updates.setdefault(wait["phase"], [])
                if wait["kind"] == "update":
                    updates[wait["phase"]].append(f"{wait['what']} at {wait['where']}")
        return updates


class DeviceWaits(Waits, TorchDispatchMode):
    """Waits counted by the ops they dispatch, plus tolist/numpy (which read a CPU tensor's memory without
    an op) and torch.tensor/as_tensor given a device (patched for the block)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        masks = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
        )
        if name in SIZE_FROM_VALUES or masks:
            self.note(name)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._patched = [(torch.Tensor, name, getattr(torch.Tensor, name)) for name in ("tolist", "numpy")]
        self._patched += [(torch, name, getattr(torch, name)) for name in ("tensor", "as_tensor")]
        for owner, name, original in self._patched:
            setattr(owner, name, self._counting(name, original, owner is torch))
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, name, original in self._patched:
            setattr(owner, name, original)
        return super().__exit__(*exc)

    def _counting(self, name, original, built_on_device: bool):
        def counted(*args, **kwargs):
            if not built_on_device or kwargs.get("device") is not None:
                self.note(f"torch.{name}(..., device=)" if built_on_device else name)
            return original(*args, **kwargs)

        return counted


class CudaWaits(Waits):
    """The same count on a GPU, from CUDA itself: torch.cuda.set_sync_debug_mode warns at every operation
    that synchronises with the device; each warning is noted where it is raised."""

    def __enter__(self):
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def show(message, category, *args, **kwargs):
            if "synchroniz" in str(message):
                self.note(str(message).splitlines()[0])
            else:
                shown(message, category, *args, **kwargs)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        return self._warnings.__exit__(*exc)


class UpdatePhases(L.Callback):
    """Files every wait under the update in progress: from a micro-batch's start to the next one's."""

    def __init__(self, counter: Waits):
        self.counter = counter

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.counter.phase = trainer.global_step + 1

    def on_train_end(self, trainer, module) -> None:
        self.counter.phase = "end"


def counted_run(counter: Waits, run, *args):
    """run(*args) (a training through transformer_mt.train) with the counter on and UpdatePhases among its
    callbacks."""
    make_callbacks = entry.make_callbacks
    entry.make_callbacks = lambda *a: [UpdatePhases(counter), *make_callbacks(*a)]
    try:
        with counter:
            return run(*args)
    finally:
        entry.make_callbacks = make_callbacks


def summary(counter: Waits) -> str:
    kinds = Counter((w["phase"] if not isinstance(w["phase"], int) else "updates", w["kind"]) for w in counter.found)
    return ", ".join(f"{phase}/{kind}: {n}" for (phase, kind), n in sorted(kinds.items(), key=str))


if (
    __name__ == "__main__"
):  # under torchrun: python device_waits.py OUT OVERRIDES...; each rank's waits -> OUT-<rank>.json
    import os

    from transformer_mt.train import main

    out, overrides = sys.argv[1], sys.argv[2:]
    sys.argv = [sys.argv[0], *overrides]
    counter = DeviceWaits()
    try:
        counted_run(counter, main)
    finally:
        Path(f"{out}-{os.environ['RANK']}.json").write_text(json.dumps(counter.found))
