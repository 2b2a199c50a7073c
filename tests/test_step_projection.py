"""scripts/step_projection.py: its byte counts against hand-computed ones, and the fused loss (objective.py) moving
fewer bytes than the loss before it, eagerly and compiled."""

import importlib.util

import pytest
import torch

from conftest import ROOT
from transformer_mt.objective import label_smoothed_nll, smoothed_cross_entropy

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


@pytest.mark.slow
def test_the_fused_loss_moves_fewer_bytes_than_the_loss_before_it_eagerly_and_compiled():
    logits = torch.randn(36, 3000, dtype=torch.bfloat16, requires_grad=True)  # bf16, as under autocast
    target = torch.randint(1, 3000, (36,))
    fused = projection.loss_bytes(smoothed_cross_entropy, logits, target, "eager")
    before = projection.loss_bytes(label_smoothed_nll, logits, target, "eager")
    assert fused <= 24 * logits.numel() * 1.01 and fused < before / 1.9, fused / logits.numel()  # bytes per logit
    # compiled (inductor): 8 bytes per logit, one read forward and one read and one write backward (the loss before it
    # compiled: 14; not compiled here, a minute of the slow tier: docs/measurements.md has the count)
    fused = projection.loss_bytes(smoothed_cross_entropy, logits, target, "compiled")
    assert fused <= 8 * logits.numel() * 1.01, fused / logits.numel()
