"""Counting the places where the host waits for the device, on a CPU: a GPU pays for each one (the queue of
kernels drains before the host goes on), a CPU does not, so a CPU test has to count them.

They are the reads of a tensor's values (item, float, bool, tolist, numpy) and the ops whose output size
depends on values (nonzero, a boolean mask's index, masked_select, unique). The CUDA tier checks the same
rule with torch.cuda.set_sync_debug_mode (tests/test_cuda.py)."""

from __future__ import annotations

import traceback

import lightning as L
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
        where = f"{frames[-1].filename.split('/')[-1]}:{frames[-1].lineno}" if frames else "lightning/torch"
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


class WaitsPerMicroBatch(L.Callback):
    """The waits of each training micro-batch (its step, backward and, for the last of an update, the
    optimizer step and every callback's batch end), and whether it ended an update."""

    def __init__(self, counter: DeviceWaits):
        self.counter, self.batches = counter, []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.start, self.step = len(self.counter.waits), trainer.global_step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.batches.append((trainer.global_step != self.step, self.counter.waits[self.start :]))
