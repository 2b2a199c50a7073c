"""glibc malloc settings for training and decoding processes (Linux; elsewhere nothing happens).

PyTorch's CPU tensors come straight from malloc. glibc serves large blocks (above a threshold
that adapts up to 32 MiB) with mmap and hands them back with munmap when freed, so every training
step maps its activations afresh and the kernel zero-fills them page by page. On Multi30k-shaped
batches (small model, fp32, 2-core AMD EPYC) that was ~46,000 minor page faults per update and
7.5% of the CPU time in the kernel; with mmap off and freed memory kept for reuse (below): ~4,000
faults, 0.9%, and 1.19x the target tokens/s (scripts/benchmark.py prints both columns).

The price: memory freed by tensors stays in the process for the next step, so resident memory
is the high-water mark of live tensors plus up to TRIM_THRESHOLD kept at the heap's top.
TRANSFORMER_MT_MALLOC=system in the environment leaves glibc's defaults alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters, from glibc's malloc.h
TRIM_THRESHOLD = 2**30  # free memory at the heap's top beyond this goes back to the system


def libc() -> ctypes.CDLL | None:
    with contextlib.suppress(OSError, AttributeError):
        lib = ctypes.CDLL("libc.so.6")
        lib.mallopt  # noqa: B018 (glibc only: musl has no mallopt)
        return lib
    return None


def keep_freed_memory() -> bool:
    """Serve every allocation from the heap (no mmap) and keep freed memory for reuse. Returns
    whether the settings took effect (False: not glibc, or TRANSFORMER_MT_MALLOC=system)."""
    lib = libc()
    if lib is None or os.environ.get("TRANSFORMER_MT_MALLOC") == "system":
        return False
    return bool(lib.mallopt(M_MMAP_MAX, 0)) and bool(lib.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def release_freed_memory() -> None:
    """Hand memory that C/C++ code freed back to the system. SentencePiece's trainer frees its gigabytes
    of sentences when it ends, but glibc keeps freed heap pages for reuse: at WMT14 scale, 4.8 GB
    stayed resident in the training process."""
    lib = libc()
    if lib is not None:
        lib.malloc_trim(0)
