"""runtime.keep_freed_memory: glibc keeps freed memory for reuse instead of mapping it afresh (page faults)."""

import os
import subprocess
import sys

import pytest

from transformer_mt.runtime import libc

pytestmark = [pytest.mark.skipif(libc() is None, reason="glibc only (mallopt)"), pytest.mark.slow]  # fresh processes

FAULTS = """
import resource, sys, torch
from transformer_mt.runtime import keep_freed_memory
print(keep_freed_memory())
for step in range(30):
    if step == 20:  # the last 10 rounds: the steady state of a training loop (the heap settles within ~10)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 * 2**20)  # 64 MiB, as one step's activations: above glibc's mmap threshold
    del x
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(setting: str) -> tuple[str, int]:
    env = {**os.environ, "TRANSFORMER_MT_MALLOC": setting}
    out = subprocess.run([sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True, check=True)
    took, faults = out.stdout.split()
    return took, int(faults)


def test_freed_tensors_are_reused_without_page_faults():
    took, kept = page_faults("")
    assert took == "True"
    declined, system = page_faults("system")  # glibc's defaults: each 64 MiB tensor is mapped and faulted in anew
    assert declined == "False"
    assert system > 10 * 16384 * 0.9  # 16,384 pages of 4 KiB per tensor, every time
    assert kept < 1000  # reused: no page is faulted in again


SHAPES = """
import ctypes, torch
from transformer_mt.runtime import bound_onednn_cache
bound_onednn_cache()  # as train() does: after torch's import, before the first product
class Heap(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
lib = ctypes.CDLL("libc.so.6")
lib.mallinfo2.restype = Heap
layer = torch.nn.Linear(64, 64)
for rows in range(1, 61):  # a new input shape each time, as token buckets give training batches
    if rows == 20:
        before = lib.mallinfo2().uordblks
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(rows, 64, requires_grad=True))
    out.float().sum().backward()
print(lib.mallinfo2().uordblks - before)
"""


@pytest.mark.skipif(not hasattr(libc(), "mallinfo2"), reason="glibc 2.33 or newer (mallinfo2)")
def test_new_input_shapes_leave_nothing_cached():
    """runtime.bound_onednn_cache: no compiled product is kept per input shape (oneDNN's and ideep's caches:
    ~0.8 MiB per shape of this layer with ideep's left at its default; the Multi30k recipe's ~3 MiB per update)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", SHAPES], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout) < 2**20  # bytes the heap holds after 40 new shapes; 0.03 MiB measured, 32 MiB before
