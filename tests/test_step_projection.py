"""scripts/step_projection.py: its byte counts against hand-computed ones, and the chunked loss (objective.py) counted
inside torch's op, moving fewer bytes than the loss before it."""

import importlib.util

import torch
import torch.nn.functional as F
from torch.nn import LinearCrossEntropyOptions

from conftest import ROOT
from transformer_mt.objective import linear_smoothed_nll

spec = importlib.util.spec_from_file_location("step_projection", ROOT / "scripts" / "step_projection.py")
projection = importlib.util.module_from_spec(spec)
spec.loader.exec_module(projection)


def test_the_counter_counts_what_each_operation_reads_and_writes():
    a, b = torch.randn(100), torch.randn(100)
    index = torch.tensor([[3], [7]])
    with projection.Counter() as counter:
        a + b  # reads 2 x 400 bytes, writes 400
    assert counter.bytes == 1200
    with projection.Counter() as counter:
        a.view(10, 10).t()  # views move nothing
        torch.empty(1000)  # nor do allocations
        torch.randn(2, 50).gather(-1, index)  # randn writes 400; gather reads and writes 2 values and the index
    assert counter.bytes == 400 + 2 * 2 * 4 + 16
    with projection.Counter() as counter:
        torch.mm(torch.ones(4, 8), torch.ones(8, 3))  # a matrix product: FLOPs, not bytes (the ones: 2 x 4 x 8 ...)
    assert counter.flops == 2 * 4 * 8 * 3 and counter.bytes == (4 * 8 + 8 * 3) * 4


def test_the_chunked_loss_is_counted_inside_its_op_and_moves_fewer_bytes_than_the_loss_before_it():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(600, 32, generator=g), torch.randn(3000, 32, generator=g)
    target = torch.randint(1, 3000, (600,), generator=g)
    with projection.Counter() as counter:
        F.linear_cross_entropy(hidden, weight.requires_grad_(True), target, options=LinearCrossEntropyOptions())
    assert counter.flops == 2 * 2 * 600 * 32 * 3000  # the logits' and W's gradient's products, counted inside the op
    logits = 600 * 3000
    chunked = projection.loss_bytes(linear_smoothed_nll, hidden, weight, target, "eager")
    before = projection.loss_bytes(projection.reference_loss, hidden, weight, target, "eager")
    # The op's loop passes over each fp32 logit 5 times, 32 bytes (the smoothing and W's gradient add O((N + V) d)),
    # the loss before it 69 bytes per logit (bf16 logits under autocast, fp32 log-probabilities).
    assert 32 * logits <= chunked <= 40 * logits and chunked < before / 1.5, (chunked / logits, before / logits)
