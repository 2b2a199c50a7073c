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
