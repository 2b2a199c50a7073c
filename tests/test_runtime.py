"""runtime.py and the strategies: TF32, the process group's end, DDP and FSDP settings, the devices' peak
FLOP/s behind the MFU."""

import contextlib
import os
import re
import signal
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.attention import SDPBackend

from transformer_mt import runtime
from transformer_mt.errors import InputError
from transformer_mt.runtime import device_peak, end_process_group, sentence_attention, use_tf32
from transformer_mt.stops import exit_after_training
from transformer_mt.training.fit import make_strategy
from transformer_mt.training.sharding import LayerFSDP, mixed_precision_policy


def test_fsdp_is_fsdp2_and_in_bf16_reduces_gradients_in_fp32():
    assert isinstance(make_strategy("fsdp"), LayerFSDP)
    mixed = mixed_precision_policy("bf16-mixed", "cuda")  # what configure_ddp shards with on a GPU (trainer.precision)
    assert isinstance(mixed, MixedPrecisionPolicy)  # fully_shard's (FSDP2), not FSDP1's MixedPrecision
    assert (mixed.param_dtype, mixed.reduce_dtype) == (torch.bfloat16, torch.float32)  # buffers: never cast
    assert mixed_precision_policy("32-true", "cuda") is None  # fp32: none at all
    # the layers' inputs: cast to bf16 on a CPU (its autocast's LayerNorm), left in fp32 on CUDA as under DDP
    assert mixed_precision_policy("bf16-mixed", "cpu").cast_forward_inputs
    assert not mixed_precision_policy("bf16-mixed", "cuda").cast_forward_inputs


def test_ddp_broadcasts_no_buffers_and_sweeps_refuse_fsdp_that_would_relaunch_them(monkeypatch):
    for name, start in (("ddp", "popen"), ("ddp_spawn", "spawn")):
        strategy = make_strategy(name)
        assert isinstance(strategy, DDPStrategy) and strategy._start_method == start, name
        assert strategy._ddp_kwargs == {"broadcast_buffers": False}  # no broadcast of the sinusoids per forward

    # a `-m` job started from a shell (train.py hands down Hydra's mode as the Job's sweep_dir)
    for key in ("LOCAL_RANK", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    assert make_strategy("ddp", sweep=True)._start_method == "spawn"
    with pytest.raises(InputError, match=r"trainer=fsdp in a Hydra multirun .* hydra/launcher=slurm"):
        make_strategy("fsdp", devices=-1, sweep=True)
    assert isinstance(make_strategy("fsdp", devices=1, sweep=True), LayerFSDP)  # one device: no other rank to start
    monkeypatch.setenv("SLURM_NTASKS", "8")  # each rank started by srun (hydra/launcher=slurm): nothing re-runs
    assert isinstance(make_strategy("fsdp", devices=-1, sweep=True), LayerFSDP)
    assert make_strategy("ddp")._start_method == "popen"


def test_use_tf32_turns_on_tf32_for_fp32_products():
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        torch.set_float32_matmul_precision("highest")
        use_tf32()
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


def test_the_process_group_ends_with_the_last_object_that_holds_it_and_its_gloo_threads_are_joined(tmp_path):
    """A gloo thread still running when the interpreter finalizes can abort the process (status -6):
    end_process_group reports the threads of a group something still holds, and none once it is dropped."""
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.distributed.all_reduce(torch.ones(3))
    holder = [torch.distributed.group.WORLD]  # as a DDP/FSDP wrapper holds its group
    assert "pt_gloo_runloop" in end_process_group()
    assert not torch.distributed.is_initialized()
    holder.clear()
    assert end_process_group() == []


@pytest.mark.parametrize(
    "name, precision, peak",
    [
        ("NVIDIA H200", "bf16-mixed", 989e12),
        ("NVIDIA H100 80GB HBM3", "32-true", 67e12),  # fp32: torch's default matmul precision is "highest"
        ("NVIDIA H100 PCIe", "bf16-mixed", 756e12),
        ("NVIDIA A100-SXM4-80GB", "16-mixed", 312e12),
        ("NVIDIA A10", "bf16-mixed", 125e12),  # not A100's
        ("NVIDIA H100 NVL", "bf16-mixed", None),  # lower clocks: left unknown rather than guessed
        ("Tesla V100-SXM2-32GB", "bf16-mixed", None),  # no bf16
    ],
)
def test_mfu_is_measured_against_the_data_sheets_peak_of_the_gpu_and_its_format(monkeypatch, name, precision, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    found = device_peak(torch.device("cuda", 0), precision)
    assert found.flops == peak
    assert (name in found.source) and (("no MFU" in found.source) == (peak is None))
    if peak:
        assert found.utilisation(peak / 4) == 0.25


def test_a_cpus_peak_is_a_matrix_product_timed_in_trainings_format():
    found = device_peak(torch.device("cpu"), "32-true")
    assert found.flops > 1e9 and re.fullmatch(
        r"[\d.]+ GFLOP/s fp32, a 2048\^3 matrix product timed on this CPU", found.source
    )


def clock(durations: list[float]):
    """time.perf_counter as matmul_peak reads it: once when timing starts, then before and after each product,
    the products taking `durations`; it runs out after the last (a product more would fail the test)."""
    readings, now = [0.0], 0.0
    for took in durations:
        readings += [now, now + took]
        now += took
    return iter(readings).__next__


@pytest.mark.parametrize(
    "durations",
    [
        [0.5, 0.2, 0.3, 0.4, 0.6],  # slow products: 5 of them, although past the second
        [0.1] * 8 + [0.04] + [0.1] * 2,  # a busy machine, quiet for one product: timing goes on until a second passed
    ],
)
def test_a_cpus_peak_is_the_fastest_product_of_a_second_of_them(durations, monkeypatch):
    monkeypatch.setattr(runtime, "time", SimpleNamespace(perf_counter=clock(durations)))  # runtime's clock only
    flops, spread = runtime.matmul_peak(torch.float32, n=16)
    assert flops == pytest.approx(2 * 16**3 / min(durations))
    assert spread == pytest.approx(max(durations) / min(durations))  # 3x and 2.5x: the probe was disturbed


def test_a_disturbed_probe_is_named_and_mfu_never_exceeds_one(monkeypatch):
    monkeypatch.setattr(runtime, "cpu_peak", lambda fmt: (100e9, 2.5))  # products 2.5x apart
    peak = device_peak(torch.device("cpu"), "32-true")
    assert peak.flops == 100e9 and peak.spread > 2
    assert peak.utilisation(50e9) == 0.5 and peak.utilisation(250e9) == 1.0  # never above 100%
    raised = peak.raised(250e9)
    assert raised.utilisation(125e9) == 0.5 and raised.source == "250 GFLOP/s, the model FLOP/s training reached"
    monkeypatch.setattr(runtime, "cpu_peak", lambda fmt: (100e9, 1.3))  # a quiet machine
    assert not device_peak(torch.device("cpu"), "32-true").spread > 2


def test_training_bounds_onednns_primitive_cache_unless_the_environment_says_otherwise(monkeypatch):
    """runtime.bound_onednn_cache: capacity 0 (host memory stays bounded, docs/measurements.md), set before the
    first product by train(); a capacity the user exported is kept."""
    monkeypatch.delenv(runtime.ONEDNN_CACHE, raising=False)
    monkeypatch.delenv(runtime.IDEEP_CACHE, raising=False)
    runtime.bound_onednn_cache()
    assert (os.environ[runtime.ONEDNN_CACHE], os.environ[runtime.IDEEP_CACHE]) == ("0", "1")
    monkeypatch.setenv(runtime.ONEDNN_CACHE, "256")
    runtime.bound_onednn_cache()
    assert os.environ[runtime.ONEDNN_CACHE] == "256"


def test_fsdp_skips_the_gradient_sync_inside_an_accumulation_as_ddps_no_sync(monkeypatch):
    """TranslationModule.training_step enters strategy.block_backward_sync() for each micro-batch but the update's
    last; for trainer=fsdp that turns FSDP2's gradient sync off for its backward (test_distributed: nothing reduced,
    then the sum of both micro-batches reduced at the next synchronised backward)."""
    calls = []
    model = SimpleNamespace(set_requires_gradient_sync=calls.append)
    strategy = make_strategy("fsdp")
    monkeypatch.setattr(LayerFSDP, "lightning_module", property(lambda self: SimpleNamespace(model=model)))
    with strategy.block_backward_sync():
        assert calls == [False]
    assert calls == [False, True]
    with pytest.raises(RuntimeError), strategy.block_backward_sync():
        raise RuntimeError("a failed backward")
    assert calls == [False, True, False, True]  # sync is back on after a failure too


def test_the_cpu_peak_probe_draws_nothing_from_the_global_random_generator():
    """device_peak measures a CPU once per process, at a run's start after seed_everything: had it drawn from the
    global generator, a process's first run would get other dropout masks than the same run started later
    (a sweep's first job, or test_protocol's straight run against its resumed one when it ran first)."""
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    runtime.matmul_peak(torch.float32, n=64, repeats=1, seconds=0)
    assert torch.equal(torch.random.get_rng_state(), before)


@pytest.mark.parametrize("fails", [False, True])
def test_a_slurm_stop_requeues_the_job_and_exits_128_plus_sigusr1(tmp_path, monkeypatch, caplog, fails):
    """SLURM's SIGUSR1 (its time limit near): the training stopped after an update, `scontrol requeue <job>` (a
    job array's task by its array name), status 138; a refused requeue is one warning naming the way on."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/called\n' + ('echo "no such job" >&2; exit 1\n' * fails))
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "7003")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "70")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    with caplog.at_level("INFO"), pytest.raises(SystemExit) as stop:
        exit_after_training(signal.SIGUSR1, global_zero=True)
    assert stop.value.code == 128 + signal.SIGUSR1
    assert (tmp_path / "called").read_text() == "requeue 70_3\n"
    said = "could not requeue SLURM job 70_3 (no such job)" if fails else "requeued SLURM job 70_3"
    assert said in caplog.text


def test_whole_sentences_attend_through_sdpas_math_kernel_on_a_cpu_in_bf16_only():
    """The caller picks the kernel (runtime.sentence_attention, around training's and validation's losses): in bf16 on
    a CPU the math backend (faster there for whole sentences), else SDPA's own choice; decoding keeps the default."""
    q = torch.randn(2, 4, 32, 16)
    choice = lambda x: SDPBackend(torch._fused_sdp_choice(x, x, x))  # noqa: E731 (torch's dispatch, no public name)
    with sentence_attention(torch.device("cpu"), "bf16-mixed"):
        assert choice(q.bfloat16()) == SDPBackend.MATH
    with sentence_attention(torch.device("cpu"), "32-true"):
        assert choice(q) == choice(q.bfloat16()) != SDPBackend.MATH
    assert isinstance(sentence_attention(torch.device("cuda"), "bf16-mixed"), contextlib.nullcontext)
