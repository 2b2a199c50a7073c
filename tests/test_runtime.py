"""runtime.py and the strategies: TF32, the process group's end, DDP and FSDP settings, the devices' peak
FLOP/s behind the MFU."""

import contextlib
import os
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


def test_a_cpu_has_no_peak_its_lines_give_flops_without_mfu():
    found = device_peak(torch.device("cpu"), "32-true")
    assert found.flops is None and found.utilisation(1e9) is None
    assert found.source == "no peak known for cpu devices: FLOP/s without MFU"


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
