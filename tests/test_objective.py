"""objective.py: the label-smoothed loss (§5.4), the formula and the one training computes from hidden rows, and the
Noam learning rate (§5.3) against independent references (torch's cross entropy, hand-computed values, the paper's
numbers)."""

import math
import sys
import warnings
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, run_process, tiny_config
from transformer_mt import objective
from transformer_mt.data.batching import collate
from transformer_mt.model import Transformer
from transformer_mt.objective import label_smoothed_nll, linear_smoothed_nll, noam_lr, sequence_losses


def random_logits(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_loss_equals_torch_cross_entropy_with_label_smoothing():
    logits = random_logits((3, 5, 11))
    target = torch.randint(1, 11, (3, 5), generator=torch.Generator().manual_seed(1))
    target[0, 3:] = 0  # padding
    target[2, 1:] = 0
    for eps in [0.0, 0.1, 0.3]:
        loss, nll, n = label_smoothed_nll(logits, target, eps, pad_id=0)
        ref = F.cross_entropy(
            logits.view(-1, 11), target.view(-1), ignore_index=0, label_smoothing=eps, reduction="sum"
        )
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(
            nll, F.cross_entropy(logits.view(-1, 11), target.view(-1), ignore_index=0, reduction="sum")
        )
        assert n.item() == 3 + 5 + 1


def test_loss_with_zero_smoothing_is_the_nll():
    logits, target = random_logits((4, 7)), torch.tensor([1, 2, 3, 6])
    loss, nll, _ = label_smoothed_nll(logits, target, 0.0, pad_id=0)
    expected = -torch.log_softmax(logits, -1)[torch.arange(4), target].sum()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(nll, expected)


def test_padded_batch_equals_the_sum_of_its_items():
    items = [
        (random_logits((n, 9), seed=n), torch.randint(1, 9, (n,), generator=torch.Generator().manual_seed(n)))
        for n in (2, 5, 3)
    ]
    logits = torch.full((3, 5, 9), 7.0)  # whatever stands at padded positions must not count
    target = torch.zeros(3, 5, dtype=torch.long)
    for row, (lg, tg) in enumerate(items):
        logits[row, : len(tg)], target[row, : len(tg)] = lg, tg
    batch = label_smoothed_nll(logits, target, 0.1, pad_id=0)
    singles = [label_smoothed_nll(lg, tg, 0.1, pad_id=0) for lg, tg in items]
    for got, parts in zip(batch, zip(*singles)):
        torch.testing.assert_close(got, sum(parts))


def test_loss_hand_computed():
    # p = softmax([0, 0, ln 2]) = [1/4, 1/4, 1/2]; target 2, eps = 0.3, V = 3:
    # q = [0.1, 0.1, 0.8]; loss = -(0.1 ln 1/4 + 0.1 ln 1/4 + 0.8 ln 1/2) = 1.2 ln 2
    logits = torch.tensor([[0.0, 0.0, math.log(2.0)]])
    loss, nll, n = label_smoothed_nll(logits, torch.tensor([2]), 0.3, pad_id=0)
    assert loss.item() == pytest.approx(1.2 * math.log(2.0), abs=1e-6)
    assert nll.item() == pytest.approx(math.log(2.0), abs=1e-6) and n.item() == 1


def values_and_grads(losses, tensors, weights=(1.0, 0.3)):
    """(loss, NLL, d(w0 loss + w1 NLL)/d each of `tensors`) of losses() -> (loss, NLL, ...)."""
    for t in tensors:
        t.grad = None
    loss, nll = losses()[:2]
    (weights[0] * loss + weights[1] * nll).backward()
    return [loss.detach(), nll.detach(), *(t.grad for t in tensors)]


def torch_cross_entropy(logits, target, eps, pad_id=-100):
    """(label-smoothed loss, NLL) sums of torch's own cross entropy."""
    loss = F.cross_entropy(logits, target, ignore_index=pad_id, label_smoothing=eps, reduction="sum")
    return loss, F.cross_entropy(logits, target, ignore_index=pad_id, reduction="sum")


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_the_loss_from_hidden_rows_and_both_gradients_equal_torch_cross_entropy_in_fp64(eps, monkeypatch):
    monkeypatch.setattr(objective, "CHUNK_BYTES", 256 * 4 * 50)  # 256 rows of 50 words a chunk
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(600, 8, dtype=torch.float64, generator=g, requires_grad=True)  # chunks of 256, 256, 88 rows
    weight = torch.randn(50, 8, dtype=torch.float64, generator=g, requires_grad=True)
    target = torch.randint(0, 50, (600,), generator=g)
    got = values_and_grads(lambda: linear_smoothed_nll(hidden, weight, target, eps), (hidden, weight))
    want = values_and_grads(lambda: torch_cross_entropy(hidden @ weight.T, target, eps), (hidden, weight))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)
    if eps == 0:
        assert torch.equal(got[0], got[1])  # the loss is the NLL


def test_bf16_hidden_rows_under_autocast_take_the_chunked_path_and_sum_in_fp32():
    """As under trainer.precision=bf16-mixed (FSDP gathers bf16 rows): no warning (the op warns when it falls back
    to the reference path, which writes the logits), the loss and W's gradient in fp32."""
    g = torch.Generator().manual_seed(5)
    hidden = (torch.randn(300, 16, generator=g) * 2).bfloat16().requires_grad_(True)
    weight = torch.randn(700, 16, generator=g, requires_grad=True)
    target = torch.randint(0, 700, (300,), generator=g)
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("error")
        got = values_and_grads(lambda: linear_smoothed_nll(hidden, weight, target, 0.1), (hidden, weight))
    assert got[0].dtype == got[1].dtype == weight.grad.dtype == torch.float32 and hidden.grad.dtype == torch.bfloat16
    h, w = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    want = values_and_grads(lambda: torch_cross_entropy(h @ w.T, target, 0.1), (h, w))
    torch.testing.assert_close(got[0].double(), want[0], rtol=1e-6, atol=0)  # fp32 sums of the same values
    torch.testing.assert_close(got[1].double(), want[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(got[2], want[2].bfloat16())  # rounded once to the rows' dtype
    torch.testing.assert_close(got[3], want[3].float(), rtol=1e-5, atol=1e-5)


def tiny_batch(sentences):
    """collate's padded batch of (source, target) length pairs, and each sentence's batch alone."""
    rng = np.random.default_rng(0)
    items = [(rng.integers(4, 23, n), rng.integers(4, 23, m), i) for i, (n, m) in enumerate(sentences)]
    return collate(items), [collate([item]) for item in items]


def test_a_padded_batch_equals_the_sum_of_its_sentences_and_torch_cross_entropy_in_fp64():
    torch.manual_seed(0)
    model = Transformer(tiny_config()).double().eval()  # eval: no dropout, the same features in every call
    params = list(model.parameters())
    batch, singles = tiny_batch([(5, 2), (3, 7), (6, 6)])
    tensors = lambda b: (b["src"], b["tgt_in"], b["tgt_out"])  # noqa: E731
    parts = [values_and_grads(partial(sequence_losses, model, *tensors(s), 0.1), params) for s in singles]
    whole = [sum(p) for p in zip(*parts)]
    logits = lambda: model.project(model.features(*tensors(batch)[:2])).flatten(0, 1)  # noqa: E731
    torch_ce = values_and_grads(lambda: torch_cross_entropy(logits(), batch["tgt_out"].flatten(), 0.1, 0), params)
    for positions in (batch["target_positions"], None):
        got = values_and_grads(partial(sequence_losses, model, *tensors(batch), 0.1, positions), params)
        assert sequence_losses(model, *tensors(batch), 0.1, positions)[2] == sum(batch["tgt_lengths"])
        for want in (whole, torch_ce):
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)


def test_the_compiled_loss_equals_the_eager_one_compiled_once_for_every_row_count():
    """trainer.compile (module.compile_training) compiles it with dynamic shapes: once, whether the rows fill one
    chunk or several, and no warning per step."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(linear_smoothed_nll, dynamic=True, fullgraph=True, backend=counting)
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(500, 16, generator=g, requires_grad=True)
    compiles = []
    for rows in (37, 300, 1000):  # CHUNK_ROWS = 256
        hidden = torch.randn(rows, 16, generator=g, requires_grad=True)
        target = torch.randint(0, 500, (rows,), generator=g)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = values_and_grads(partial(compiled, hidden, weight, target, 0.1), (hidden, weight))
        want = values_and_grads(partial(linear_smoothed_nll, hidden, weight, target, 0.1), (hidden, weight))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
        compiles.append(len(graphs))
    assert compiles[0] == compiles[-1] <= 2, compiles  # at the first call only (whose trace may reach it twice)
    torch._dynamo.reset()


# Resident memory is the allocator's: every block over 64 KiB its own mapping, given back when freed (glibc's
# MALLOC_MMAP_THRESHOLD_), so the peak of the process's resident memory (VmHWM, reset to the current resident memory
# by clear_refs 5) is that of its live tensors. Not ru_maxrss: a child starts with its parent's.
PEAK_PROBE = """
import sys, torch
from transformer_mt.objective import linear_smoothed_nll
n, d, v = map(int, sys.argv[1:])
kib = lambda key: int(open("/proc/self/status").read().split(key + ":")[1].split()[0])
g = torch.Generator().manual_seed(0)
small = torch.randn(64, d, requires_grad=True)
linear_smoothed_nll(small, small, torch.arange(64), 0.1)[0].backward()  # code loaded
hidden = torch.empty(n, d).normal_(generator=g).requires_grad_(True)
weight = torch.empty(v, d).normal_(std=d**-0.5, generator=g).requires_grad_(True)
hidden.grad, weight.grad = torch.zeros_like(hidden), torch.zeros_like(weight)
target = torch.randint(0, v, (n,), generator=g)
open("/proc/self/clear_refs", "w").write("5")
base = kib("VmRSS")
linear_smoothed_nll(hidden, weight, target, 0.1)[0].backward()
print((kib("VmHWM") - base) / 1024)
"""


@pytest.mark.slow
def test_the_loss_of_wmt14_sized_rows_peaks_far_below_its_logits():
    """Forward and backward of the loss at 8,192 rows, d = 512, 37,000 words, in a fresh process: its peak above the
    inputs, W and their gradients (the fp32 logits alone: 1,156 MiB; docs/measurements.md has the figure)."""
    probe = run_process(
        [sys.executable, "-c", PEAK_PROBE, "8192", "512", "37000"], ROOT, {"MALLOC_MMAP_THRESHOLD_": "65536"}
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert float(probe.stdout) <= 300, f"{float(probe.stdout):.0f} MiB above the baseline"


def test_noam_peaks_at_warmup_with_the_papers_values():
    assert noam_lr(4000, 512, 4000) == pytest.approx(6.99e-4, rel=1e-3)  # base
    assert noam_lr(4000, 1024, 4000) == pytest.approx(4.94e-4, rel=1e-3)  # big
    assert noam_lr(100, 512, 4000) == pytest.approx(512**-0.5 * 100 * 4000**-1.5)  # linear warmup
    assert noam_lr(40000, 512, 4000) == pytest.approx(512**-0.5 * 40000**-0.5)  # inverse square root
    assert noam_lr(1000, 512, 4000, factor=2.0) == pytest.approx(2 * noam_lr(1000, 512, 4000))
