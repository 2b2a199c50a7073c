"""The GPU paths against the CPU: same weights, same answers. Skipped without a CUDA GPU; `make gpu-check` runs them."""

import copy
import os

import pytest
import torch
import torch.distributed as dist

from conftest import free_port, random_batch, tiny_config
from transformer_mt.configs import compose
from transformer_mt.model import Transformer
from transformer_mt.objective import label_smoothed_nll, sequence_losses
from transformer_mt.search import beam_search, greedy
from transformer_mt.tokenizer import EOS_ID, source_batch
from transformer_mt.training.sharding import mixed_precision_policy, shard

pytestmark = pytest.mark.cuda
# cuBLAS is deterministic only with a fixed workspace, set before its first use in this process (as
# Lightning's trainer.deterministic=true does); it changes nothing else here.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

SOURCES = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22], [23], [24, 25, 26, 27]]


@pytest.fixture(autouse=True)
def full_fp32_matmuls():
    """fp32 comparisons mean fp32 products: no TF32 (PyTorch's default, set here in case a user changed it)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def cpu_and_cuda(seed: int = 0, **overrides) -> tuple[Transformer, Transformer]:
    """The same random weights on the CPU and on the GPU, fp32, eval mode; d = 64 so the fused kernels apply."""
    torch.manual_seed(seed)
    values = dict(vocab_size=60, d_model=64, d_ff=128, n_heads=4, max_positions=128, dropout=0.0)
    cpu = Transformer(tiny_config(**{**values, **overrides})).eval()
    return cpu, copy.deepcopy(cpu).cuda()


def test_forward_in_fp32_matches_the_cpu():
    cpu, gpu = cpu_and_cuda()
    src = random_batch([9, 5, 12, 2], 60, seed=1)  # padded sources: the boolean key mask on the GPU kernels
    tgt = random_batch([8, 8, 3, 11], 60, seed=2)
    with torch.no_grad():
        expected, got = cpu(src, tgt), gpu(src.cuda(), tgt.cuda()).cpu()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_bf16_autocast_training_step_is_finite_and_close_to_fp32():
    _, model = cpu_and_cuda()
    model.train()
    # The last source is one token and 11 of padding, the most a real batch has: collate ends every source with
    # EOS (and empty pairs are dropped), so no source is all padding, a row the memory-efficient kernel turns to NaN.
    src = random_batch([9, 5, 12, 1], 60, seed=1).cuda()
    tgt_in = random_batch([8, 8, 3, 11], 60, seed=2).cuda()
    tgt_out = random_batch([8, 8, 3, 11], 60, seed=3).cuda()

    def loss(autocast: bool) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss_sum, _, n = label_smoothed_nll(model(src, tgt_in), tgt_out, 0.1)
        return loss_sum / n

    with torch.no_grad():
        reference = loss(autocast=False).item()
    bf16 = loss(autocast=True)
    assert bf16.dtype == torch.float32 and torch.isfinite(bf16)  # the loss is computed in fp32 from bf16 logits
    assert bf16.item() == pytest.approx(reference, rel=2e-2)
    bf16.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert sum(g.abs().sum().item() > 0 for g in grads.values()) == len(grads)  # every parameter learns
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    # as training/module.py
    torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9, fused=True).step()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all() and not torch.equal(p, before[name]), name


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_cached_decoding_equals_recomputation_on_cuda(autocast):
    _, model = cpu_and_cuda()
    src = random_batch([7, 3, 9], 60, seed=1).cuda()
    tgt = random_batch([10, 10, 10], 60, seed=2).cuda()
    # bf16 (8 bits of mantissa) rounds the cached step's products, of other shapes, differently
    tolerance = 1e-1 if autocast else 1e-4
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        full = model(src, tgt).float()
        state = model.start_decoding(*model.encode(src))
        for t in range(tgt.size(1)):
            step = model.decode_step(tgt[:, t], state).float()
            torch.testing.assert_close(step, full[:, t], atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("seed", range(3))
def test_greedy_and_beam_search_give_the_cpus_tokens(seed):
    cpu, gpu = cpu_and_cuda(seed)
    for model in (cpu, gpu):  # raise EOS, so hypotheses end at varied lengths and beams finish early
        with torch.no_grad():
            model.embed.tokens.weight[EOS_ID] *= 3
    src = source_batch(SOURCES)
    assert greedy(gpu, src.cuda(), max_len_b=12) == greedy(cpu, src, max_len_b=12)
    nbest_cpu = beam_search(cpu, src, beam_size=4, max_len_b=12, n_best=4)
    nbest_gpu = beam_search(gpu, src.cuda(), beam_size=4, max_len_b=12, n_best=4)
    for hyps_gpu, hyps_cpu in zip(nbest_gpu, nbest_cpu):
        assert [tokens for tokens, _ in hyps_gpu] == [tokens for tokens, _ in hyps_cpu]
        assert [score for _, score in hyps_gpu] == pytest.approx([score for _, score in hyps_cpu], abs=1e-4)


def test_fp32_training_on_cuda_uses_tf32(record_property):
    from transformer_mt.training.fit import trainer_arguments  # noqa: PLC0415

    a, b = torch.randn(2048, 2048, device="cuda"), torch.randn(2048, 2048, device="cuda")
    exact = (a.double() @ b.double()).float()

    def error() -> float:
        return ((a @ b - exact).abs().max() / exact.abs().max()).item()

    full = error()  # "highest": the autouse fixture
    trainer_arguments(compose("train", ["trainer=gpu", "trainer.precision=32-true"]).trainer)
    assert torch.get_float32_matmul_precision() == "high"
    tf32 = error()
    record_property(
        "figures", f"relative error of an fp32 product: {full:.1e} full fp32, {tf32:.1e} after train's setup"
    )
    assert tf32 > 10 * full  # TF32 rounds the inputs to 10 mantissa bits: the products really ran in TF32


def training_run(deterministic: bool) -> dict[str, torch.Tensor]:
    """3 bf16 updates of a small model with dropout 0.1 from seed 0, as train.py runs them."""
    torch.use_deterministic_algorithms(deterministic)
    try:
        torch.manual_seed(0)
        values = dict(vocab_size=1000, d_model=256, d_ff=1024, n_heads=4, max_positions=128, dropout=0.1)
        model = Transformer(tiny_config(**values)).cuda().train()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
        for step in range(3):
            src = random_batch([30, 25, 12, 28] * 8, 1000, seed=step).cuda()
            tgt = random_batch([27, 30, 15, 22] * 8, 1000, seed=step + 10).cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss_sum, _, n = label_smoothed_nll(model(src, tgt), tgt, 0.1)
            (loss_sum / n).backward()
            optimizer.step()
            optimizer.zero_grad()
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    finally:
        torch.use_deterministic_algorithms(False)


def test_deterministic_switch_repeats_training_bit_for_bit(record_property):
    """trainer.deterministic=true (torch.use_deterministic_algorithms): the same updates twice give the same
    bits; without it, CUDA's atomic adds (the embedding's backward, some attention backward kernels) may not."""
    runs = [training_run(deterministic=True) for _ in range(2)]
    differ = [k for k in runs[0] if not torch.equal(runs[0][k], runs[1][k])]
    free = [training_run(deterministic=False) for _ in range(2)]
    differ_free = [k for k in free[0] if not torch.equal(free[0][k], free[1][k])]
    record_property(
        "figures",
        f"deterministic: {len(differ)} of {len(runs[0])} tensors differ; default kernels: {len(differ_free)} differ",
    )
    assert not differ, differ[:5]


def test_fsdp_in_bf16_leaves_each_layers_inputs_in_fp32_as_ddp(record_property):
    """trainer=fsdp's bf16 policy on CUDA (one rank, NCCL): under autocast the weights are gathered in bf16 and every
    layer's inputs (the residual stream, the encoder's output) arrive in fp32, as under DDP; FSDP2's default would
    cast them to bf16 at every layer. A training step's loss then equals DDP's (an unsharded model) closely."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = Transformer(tiny_config(d_model=64, d_ff=128, n_heads=4, max_positions=128, dropout=0.0)).cuda()
        model = copy.deepcopy(plain)
        shard(model, "cuda", 1, mixed_precision_policy("bf16-mixed", "cuda"))
        inputs, gathered = set(), set()

        def record(module, args, kwargs):  # after FSDP's own pre-forward hook: the layer's weights are gathered
            inputs.update(t.dtype for t in [*args, *kwargs.values()] if torch.is_tensor(t) and t.is_floating_point())
            gathered.update(p.dtype for p in module.parameters())

        for layer in [*model.encoder_layers, *model.decoder_layers]:
            layer.register_forward_pre_hook(record, with_kwargs=True)
        src = random_batch([7, 5, 6, 3], 23, seed=1).cuda()
        tgt = random_batch([5, 6, 2, 4], 23, seed=2).cuda()
        losses = []
        for m in (model, plain):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _, n = sequence_losses(m, src, tgt, tgt, 0.1)
            (loss / n).backward()
            losses.append((loss / n).item())
        record_property("figures", f"inputs {sorted(map(str, inputs))}, weights {sorted(map(str, gathered))}")
        assert inputs == {torch.float32} and gathered == {torch.bfloat16}
        assert losses[0] == pytest.approx(losses[1], rel=2e-2)  # bf16 weights against autocast's casts of fp32 ones
    finally:
        dist.destroy_process_group()
