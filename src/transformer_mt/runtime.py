"""The machine a process runs on: devices, CPU threads, CPU features, and glibc's allocator.

glibc malloc settings for training and decoding processes (Linux; elsewhere nothing happens):

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
import functools
import gc
import logging
import os
import platform
import re
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from transformer_mt.errors import InputError

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters, from glibc's malloc.h
TRIM_THRESHOLD = 2**30  # free memory at the heap's top beyond this goes back to the system


def libc() -> ctypes.CDLL | None:
    with contextlib.suppress(OSError, AttributeError):
        lib = ctypes.CDLL("libc.so.6")
        lib.mallopt  # noqa: B018 (glibc only: musl has no mallopt)
        return lib
    return None


ONEDNN_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
IDEEP_CACHE = "LRU_CACHE_CAPACITY"  # ideep, PyTorch's layer over oneDNN: its own cache, 1,024 by default


def bound_onednn_cache() -> None:
    """bf16 and fp32 products on the CPU go through ideep and oneDNN, and each keeps what it compiled for
    every input shape it meets, up to 1,024 shapes, with its buffers; token buckets give almost every
    training batch a new shape. oneDNN's cache grew the process by ~12 MiB per update (the Multi30k recipe
    on 2 CPU cores, bf16) and ideep's by ~3 MiB more: capacity 0 for oneDNN and 1 for ideep (0 crashes it)
    keep neither (docs/measurements.md, host memory). Set before the first product; a capacity already in
    the environment wins."""
    os.environ.setdefault(ONEDNN_CACHE, "0")
    os.environ.setdefault(IDEEP_CACHE, "1")


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


def pick_device(name: str) -> torch.device:
    """`auto` = the first CUDA GPU when there is one, else the CPU; otherwise a torch device name."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"device={name}: no CUDA GPU is visible here; use device=cpu (or device=auto)")
    return torch.device(name)


def set_threads(threads: int) -> None:
    """CPU threads for torch (0: leave torch's default, every core). Fewer threads than cores pay off
    when other processes keep cores busy: decoding Multi30k on 2 cores beside one busy process,
    2 threads gave 32 sentences/s and 1 thread 76 (alone: 114 and 75), as threads that wait for
    a descheduled sibling at every small operation stall the whole step."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise InputError(f"threads={threads!r}: must be a whole number >= 0 (0 = every core)")
    if threads:
        torch.set_num_threads(threads)


def cpuinfo() -> str | None:
    """/proc/cpuinfo, or None where there is none (not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: without either, bf16 matrix products are emulated (~20x slower than fp32)."""
    text = cpuinfo()
    if text is None:
        return True  # not Linux: trust the configuration
    return "avx512_bf16" in text or "amx_bf16" in text


def describe_machine() -> str:
    """CPU model and vector extensions, torch threads and version: what every speed figure is stated with."""
    lines = (cpuinfo() or "").split("\n")
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    flags = next((line for line in lines if line.startswith("flags")), "")
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    return (
        f"{model} ({platform.machine()}, {'/'.join(simd) or 'no AVX2'}), {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}"
    )


def usable_cores() -> int:
    """The cores this process may run on (SLURM's cpus_per_task, taskset, cgroups), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def use_tf32() -> None:
    """fp32 matrix products (and cuDNN convolutions) on CUDA tensor cores in TF32: the inputs rounded to a
    10-bit mantissa, sums in fp32, several times faster than full fp32 from Ampere on. PyTorch leaves it
    off by default; bf16-mixed training does not use it (its products are bf16)."""
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True


# Dense (no sparsity) peaks in TFLOP/s from NVIDIA's data sheets, by the format of training's matrix products,
# for the device names they match (re.search). H100/H200 are the SXM parts; NVL parts are left unknown, not guessed.
PEAK_TFLOPS = [
    (r"H[12]00(?!.*(PCIe|NVL))", {"bf16": 989, "fp16": 989, "tf32": 495, "fp32": 67}),
    (r"H100 PCIe", {"bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51}),
    (r"A100", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
    (r"\bA10\b", {"bf16": 125, "fp16": 125, "tf32": 62.5, "fp32": 31.2}),
    (r"L40S", {"bf16": 362, "fp16": 362, "tf32": 183, "fp32": 91.6}),
    (r"\bL4\b", {"bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30.3}),
    (r"RTX 4090", {"bf16": 165, "fp16": 165, "tf32": 82.6, "fp32": 82.6}),
    (r"V100", {"fp16": 125, "fp32": 15.7}),
]


@dataclass(frozen=True)
class Peak:
    """What model FLOP/s are measured against: FLOP/s per device (None when unknown) and where it comes from."""

    flops: float | None
    source: str
    spread: float = 1.0  # a measured peak's slowest product / its fastest: above DISTURBED, other work took the cores
    fmt: str | None = None  # a CPU's measured peak: the format it was measured in (it can be measured again)

    DISTURBED = 2.0

    @property
    def disturbed(self) -> bool:
        return self.spread > self.DISTURBED

    def utilisation(self, flops_per_second: float) -> float | None:
        """The share of the peak, never above 1: model FLOP/s above it say the peak is too low (raised)."""
        return min(flops_per_second / self.flops, 1.0) if self.flops else None

    def raised(self, flops_per_second: float) -> Peak:
        """The peak once training ran faster than it: what training reached (a CPU's probe was disturbed)."""
        return Peak(flops_per_second, f"{flops_text(flops_per_second)}, the model FLOP/s training reached", self.spread)

    def remeasured(self) -> Peak:
        """A CPU's peak measured again; the better of the two (a probe disturbed by other work reads too low)."""
        flops, spread = matmul_peak(torch.bfloat16 if self.fmt == "bf16" else torch.float32)
        if not self.flops or flops <= self.flops:
            return self
        return Peak(
            flops, f"{flops_text(flops)} {self.fmt}, a 2048^3 matrix product timed on this CPU", spread, self.fmt
        )


def matmul_format(precision: str, device: torch.device) -> str:
    """The format training's matrix products compute in: bf16, fp16, tf32 (fp32 on CUDA tensor cores, as
    use_tf32 allows) or fp32."""
    precision = str(precision)
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    tf32 = device.type == "cuda" and torch.get_float32_matmul_precision() != "highest"
    return "tf32" if tf32 else "fp32"


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5, seconds: float = 1.0) -> tuple[float, float]:
    """FLOP/s of a large square matrix product in `dtype` on the CPU: the fastest of the products timed one
    after another for `seconds` (at least `repeats` of them), after a warm-up, and their spread (the slowest
    product's time / the fastest's). Other processes that take the cores for a moment slow some of them, not
    the fastest (5 products in a row, ~0.1 s in bf16, once gave 371 GFLOP/s on a CPU that measures ~850, and
    that run's every MFU twice the real one); a spread over 2 says they did (Peak.disturbed)."""
    values = torch.Generator().manual_seed(0)  # not the global generator: a run's dropout must not depend on whether
    # this process measured the peak before (it does once: the first run of a sweep would differ from a rerun)
    a, b = (torch.randn(n, n, generator=values).to(dtype) for _ in range(2))
    a @ b  # the first product allocates and wakes the threads
    fastest, slowest, done, began = float("inf"), 0.0, 0, time.perf_counter()
    while True:
        start = time.perf_counter()
        a @ b
        end = time.perf_counter()
        fastest, slowest, done = min(fastest, end - start), max(slowest, end - start), done + 1
        if done >= repeats and end - began >= seconds:
            return 2 * n**3 / fastest, slowest / fastest


def device_peak(device: torch.device, precision: str) -> Peak:
    """The peak of one training device: a GPU's from PEAK_TFLOPS, a CPU's measured here (the fastest 2048^3
    product in training's format over ~1 s): CPUs differ too much for a table (cores, AVX-512, AMX, clocks)."""
    fmt = matmul_format(precision, device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peaks = next((peaks for pattern, peaks in PEAK_TFLOPS if re.search(pattern, name)), None)
        if peaks is None:
            return Peak(None, f"no peak known for {name}: no MFU (add its data sheet's to runtime.PEAK_TFLOPS)")
        if fmt not in peaks:
            return Peak(None, f"no {fmt} peak known for {name}: no MFU")
        return Peak(peaks[fmt] * 1e12, f"{peaks[fmt]:g} TFLOP/s {fmt} dense, {name}'s data sheet")
    if device.type != "cpu":
        return Peak(None, f"no peak known for {device.type} devices: no MFU")
    flops, spread = cpu_peak(fmt)
    return Peak(flops, f"{flops_text(flops)} {fmt}, a 2048^3 matrix product timed on this CPU", spread, fmt)


@functools.cache
def cpu_peak(fmt: str) -> tuple[float, float]:
    """matmul_peak in format `fmt` (bf16 or fp32), timed once per process: a second training in the same
    process (a sweep's job, a test) reuses it instead of spending another second."""
    return matmul_peak(torch.bfloat16 if fmt == "bf16" else torch.float32)


def duration(seconds: float) -> str:
    """Seconds for a person, H:MM:SS (past a time limit, an ETA is 0:00:00, not "-1 day")."""
    return str(timedelta(seconds=int(max(seconds, 0))))


def flops_text(flops_per_second: float) -> str:
    """FLOP/s for a person, at least 3 significant digits: 412 GFLOP/s or 0.0512 GFLOP/s on a CPU, 1.34 TFLOP/s on
    an AMX CPU, 412.3 TFLOP/s on a GPU."""
    if flops_per_second >= 1e12:
        tera = flops_per_second / 1e12
        return f"{tera:,.{2 if tera < 10 else 1}f} TFLOP/s"
    return f"{flops_per_second / 1e9:.3g} GFLOP/s"


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(worker_id: int = 0) -> None:
    """A data loader's worker_init_fn: on Linux, the kernel kills this worker when the training process
    dies, however it dies (SIGKILL included), instead of leaving it running. The stop signals (Ctrl+C,
    SIGTERM, SLURM's SIGUSR1 reach the whole process group) are the training process's to handle: a
    worker ignores them, so that the update in progress can finish."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def end_process_group() -> list[str]:
    """Destroy the job's process group and collect what still holds it (the Trainer's DDP/FSDP wrappers:
    call this once they are out of scope), so that gloo's worker threads are joined before the interpreter
    exits. Those threads release a collective's tensors just after the collective returns; one that did so
    while the interpreter was finalizing could not take the GIL and aborted its process ("terminate called
    without an active exception", status -6) now and then under torchrun and srun (pytorch/pytorch#190489).
    Returns the names of gloo threads still running (Linux; [] elsewhere): none when the group is gone."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.collect()
    return gloo_threads()


def gloo_threads() -> list[str]:
    return [name for name in thread_names() if name.startswith(("pt_gloo", "gloo"))]


def leave_if_gloo_remains(status: int) -> None:
    """End the process now, past Python's finalization, where gloo's threads outlive the process group: under
    trainer=fsdp, FSDP2's per-layer states keep the group alive after the run (a reference cycle that runs through
    hooks held on the C++ side, which Python's gc cannot collect), and a gloo thread that released a tensor while
    the interpreter was finalizing aborted its process (end_process_group). Logs and output are flushed first; the
    process ends with `status`, the run's own. Elsewhere (DDP, one process) a no-op: the exit is Python's."""
    if not gloo_threads():
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def thread_names() -> list[str]:
    """The names of this process's threads (Linux: /proc/self/task; [] elsewhere)."""
    names = []
    with contextlib.suppress(OSError):
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(OSError):
                names.append((task / "comm").read_text().strip())
    return names
