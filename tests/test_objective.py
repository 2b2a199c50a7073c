"""objective.py: the label-smoothed loss (§5.4) and the Noam learning rate (§5.3) against independent
references (torch's cross entropy, hand-computed values, the paper's numbers)."""

import math

import pytest
import torch
import torch.nn.functional as F

import transformer_mt.objective
from transformer_mt.objective import label_smoothed_nll, noam_lr, smoothed_cross_entropy


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


def reference_and_fused(logits, target, eps, weights=(1.0, 0.3)):
    """(loss, NLL, d(w0 loss + w1 NLL)/d logits) of torch's cross entropy in fp64 on the same values (label
    smoothing as label_smoothed_nll's, tested above), and of the fused smoothed_cross_entropy on the logits as given."""
    results = []
    for x, fn in ((logits.detach().double(), "reference"), (logits.detach(), "fused")):
        x.requires_grad_(True)
        if fn == "reference":
            loss = F.cross_entropy(x, target, label_smoothing=eps, reduction="sum")
            nll = F.cross_entropy(x, target, reduction="sum")
        else:
            loss, nll = smoothed_cross_entropy(x, target, eps)
        (weights[0] * loss + weights[1] * nll).backward()
        results.append((loss.detach(), nll.detach(), x.grad))
    return results


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("chunk_values", [2**24, 7 * 50])  # one chunk; chunks of 7 rows, the last one short
def test_the_fused_loss_and_its_gradient_equal_label_smoothing_in_fp64(eps, chunk_values, monkeypatch):
    monkeypatch.setattr(transformer_mt.objective, "CHUNK_VALUES", chunk_values)
    logits = random_logits((40, 50), seed=3)
    target = torch.randint(1, 50, (40,), generator=torch.Generator().manual_seed(4))
    (ref_loss, ref_nll, ref_grad), (loss, nll, grad) = reference_and_fused(logits, target, eps)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(nll.double(), ref_nll, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-7)
    assert grad.dtype == logits.dtype


def test_the_fused_loss_of_bf16_logits_is_computed_in_fp32_and_its_gradient_rounded_once():
    logits = (random_logits((64, 300), seed=5) * 2).bfloat16()  # large logits: bf16's worst case
    target = torch.randint(1, 300, (64,), generator=torch.Generator().manual_seed(6))
    (ref_loss, ref_nll, ref_grad), (loss, nll, grad) = reference_and_fused(logits, target, 0.1)
    assert loss.dtype == nll.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-4)  # fp32 sums of exact bf16 values
    torch.testing.assert_close(nll.double(), ref_nll, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(grad, ref_grad.bfloat16(), rtol=0.01, atol=1e-5)  # bf16's rounding of fp64's


def test_the_fused_loss_traced_by_torch_compile_equals_the_eager_one():
    torch._dynamo.reset()
    logits = random_logits((33, 20), seed=7)
    target = torch.randint(1, 20, (33,), generator=torch.Generator().manual_seed(8))
    eager = reference_and_fused(logits, target, 0.1)[1]
    compiled_fn = torch.compile(smoothed_cross_entropy, backend="aot_eager", fullgraph=True)
    x = logits.clone().requires_grad_(True)
    loss, nll = compiled_fn(x, target, 0.1)
    (loss + 0.3 * nll).backward()
    for got, want in zip((loss, nll, x.grad), eager):
        torch.testing.assert_close(got, want)


def test_noam_peaks_at_warmup_with_the_papers_values():
    assert noam_lr(4000, 512, 4000) == pytest.approx(6.99e-4, rel=1e-3)  # base
    assert noam_lr(4000, 1024, 4000) == pytest.approx(4.94e-4, rel=1e-3)  # big
    assert noam_lr(100, 512, 4000) == pytest.approx(512**-0.5 * 100 * 4000**-1.5)  # linear warmup
    assert noam_lr(40000, 512, 4000) == pytest.approx(512**-0.5 * 40000**-0.5)  # inverse square root
    assert noam_lr(1000, 512, 4000, factor=2.0) == pytest.approx(2 * noam_lr(1000, 512, 4000))
