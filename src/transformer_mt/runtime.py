"""The machine a process runs on: devices, CPU threads and features, a GPU's peak FLOP/s, glibc's allocator, process
ends."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from transformer_mt.errors import InputError

if TYPE_CHECKING:  # compile_decoding's annotations only: the model needs nothing from here
    from transformer_mt.decoding_state import DecoderState
    from transformer_mt.model import Transformer

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters, from glibc's malloc.h
ONEDNN_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
IDEEP_CACHE = "LRU_CACHE_CAPACITY"  # ideep, PyTorch's layer over oneDNN: its own cache, 1,024 by default


def libc() -> ctypes.CDLL | None:
    with contextlib.suppress(OSError, AttributeError):
        lib = ctypes.CDLL("libc.so.6")
        lib.mallopt  # noqa: B018 (glibc only: musl has no mallopt)
        return lib
    return None


def bound_onednn_cache() -> None:
    """No compiled product kept per input shape (~15 MiB per update); before the first product; the environment wins."""
    # capacity 0 for oneDNN, 1 for ideep (0 crashes it): docs/measurements.md, host memory
    os.environ.setdefault(ONEDNN_CACHE, "0")
    os.environ.setdefault(IDEEP_CACHE, "1")


def keep_freed_memory() -> bool:
    """No mmap, freed memory kept (46,000 -> 4,000 page faults per update, 1.19x tokens/s); whether it took effect."""
    lib = libc()
    if lib is None or os.environ.get("TRANSFORMER_MT_MALLOC") == "system":
        return False
    return bool(lib.mallopt(M_MMAP_MAX, 0)) and bool(lib.mallopt(M_TRIM_THRESHOLD, 2**30))


def pick_device(name: str) -> torch.device:
    """`auto`: the first CUDA GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"device={name}: no CUDA GPU is visible here; use device=cpu (or device=auto)")
    return torch.device(name)


def set_threads(threads: int) -> None:
    """CPU threads for torch (0: torch's default, every core)."""
    if threads < 0:  # its type is settings.InferenceSettings'
        raise InputError(f"threads={threads}: must be 0 (every core) or more")
    if threads:
        torch.set_num_threads(threads)


def cpuinfo() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/cpuinfo").read_text()
    return ""


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: without either, bf16 products are emulated (~20x slower than fp32); not Linux: True."""
    text = cpuinfo()
    return not text or "avx512_bf16" in text or "amx_bf16" in text


def usable_cores() -> int:
    """The cores this process may run on (SLURM, taskset, cgroups), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def sentence_attention(device: torch.device, precision) -> contextlib.AbstractContextManager:
    """SDPA's kernel for whole sentences (training, validation's loss): on a CPU in bf16 its math backend, the fused
    one was slower there (a Multi30k training step on an AVX512-BF16 CPU: 2,595 vs 3,347 target tok/s); else the
    default, faster in fp32 and for decoding's few queries per row (small model, fp32: training +12% target tok/s,
    greedy decoding +23%)."""
    bf16_cpu = device.type == "cpu" and str(precision).startswith("bf16")
    return sdpa_kernel(SDPBackend.MATH) if bf16_cpu else contextlib.nullcontext()


def use_tf32() -> None:
    """fp32 products on CUDA tensor cores in TF32 (off in PyTorch by default)."""
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True


# Dense peaks in TFLOP/s from NVIDIA's data sheets, by format, for the device names they match (re.search).
# H100/H200 are the SXM parts; NVL parts are left unknown, not guessed.
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
    """The FLOP/s per device that MFU is measured against (None: unknown), and where it comes from."""

    flops: float | None
    source: str

    def utilisation(self, flops_per_second: float) -> float | None:
        return flops_per_second / self.flops if self.flops else None


def device_peak(device: torch.device, precision: str) -> Peak:
    """A GPU's peak from PEAK_TFLOPS (Lightning's get_available_flops gives the H200 its sparse figure and does not
    match "NVIDIA H200"). A CPU's is not known: its lines give FLOP/s without MFU."""
    if device.type != "cuda":
        return Peak(None, f"no peak known for {device.type} devices: FLOP/s without MFU")
    tf32 = torch.get_float32_matmul_precision() != "highest"
    fmt = {"bf16": "bf16", "16": "fp16"}.get(str(precision).split("-")[0], "tf32" if tf32 else "fp32")
    name = torch.cuda.get_device_name(device)
    peaks = next((peaks for pattern, peaks in PEAK_TFLOPS if re.search(pattern, name)), {})
    if fmt not in peaks:
        return Peak(None, f"no {fmt} peak known for {name}: no MFU (add its data sheet's to runtime.PEAK_TFLOPS)")
    return Peak(peaks[fmt] * 1e12, f"{peaks[fmt]:g} TFLOP/s {fmt} dense, {name}'s data sheet")


def code_record() -> dict:
    """What code runs: the git commit of the package's checkout and whether its tracked files differ from it (or "not
    a git checkout": an installed copy), where it lies, and the versions of the package, torch and Lightning."""
    source = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=source, capture_output=True, text=True, timeout=30, check=True).stdout

    try:  # an installed copy inside a checkout (a .venv) is not what that checkout's commit holds
        commit = git("rev-parse", "HEAD").strip() if git("ls-files", "__init__.py").strip() else None
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip()) if commit else None
    except (OSError, subprocess.SubprocessError):
        commit = dirty = None
    versions = {}
    for name in ("transformer-mt", "torch", "lightning"):
        with contextlib.suppress(PackageNotFoundError):  # the package run from its source folder (PYTHONPATH)
            versions[name] = version(name)
    return {"commit": commit or "not a git checkout", "dirty": dirty, "source": str(source), **versions}


def duration(seconds: float) -> str:
    """H:MM:SS (past a time limit, an ETA is 0:00:00, not "-1 day")."""
    return str(timedelta(seconds=int(max(seconds, 0))))


def flops_text(flops_per_second: float) -> str:
    """At least 3 significant digits: 412 GFLOP/s, 0.0512 GFLOP/s, 1.34 TFLOP/s, 412.3 TFLOP/s."""
    if flops_per_second >= 1e12:
        tera = flops_per_second / 1e12
        return f"{tera:,.{2 if tera < 10 else 1}f} TFLOP/s"
    return f"{flops_per_second / 1e9:.3g} GFLOP/s"


def end_process_group() -> list[str]:
    """Destroy the process group (after the Trainer's wrappers); the gloo threads still running (see below)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.collect()
    return gloo_threads()


def gloo_threads() -> list[str]:
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):  # nothing outside Linux
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            names.append(comm.read_text().strip())
    return [name for name in names if name.startswith(("pt_gloo", "gloo"))]


def leave_if_gloo_remains(status: int) -> None:
    """Exit past finalization if gloo's threads outlive the group: they abort it (-6, pytorch/pytorch#190489)."""
    # trainer=fsdp: FSDP2's per-layer states hold the group through C++ hooks gc cannot collect
    if not gloo_threads():
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def compile_decoding(model: Transformer) -> Transformer:
    """`model`'s encode and decode_step through torch.compile with dynamic shapes, for this instance (its state_dict
    stays eager's); the first batches compile."""
    step = torch.compile(model.decode_step, dynamic=True)

    def decode_step(prev: torch.Tensor, state: DecoderState) -> torch.Tensor:
        state.make_contiguous()  # strides are guarded like shapes: contiguous inputs keep it to a few graphs
        return step(prev.contiguous(), state)

    model.encode = torch.compile(model.encode, dynamic=True)  # instance attributes shadow the methods
    model.decode_step = decode_step
    # at least 32 recompiles (8 by default): torch.compiler has no public setting for it, dynamo's config has
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    return model
