"""Token-bucket batching: collate, the batch plan, epochs, ranks, resumption and the update's shape (issue: data)."""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, SHARED_DATA, tiny_config
from transformer_mt.data.batching import TokenBucketSampler, collate, update_shape
from transformer_mt.model import Transformer
from transformer_mt.objective import sequence_losses
from transformer_mt.tokenizer import BOS_ID, EOS_ID, PAD_ID

# ---------------------------------------------------------------- collate


def test_collate_shifts_target_right():
    batch = collate([(np.array([5, 6, 7]), np.array([8, 9]), 4), (np.array([5]), np.array([10, 11, 12]), 1)])
    assert batch["index"].tolist() == [4, 1]
    assert batch["src"].tolist() == [[5, 6, 7, EOS_ID], [5, EOS_ID, PAD_ID, PAD_ID]]
    assert batch["tgt_in"].tolist() == [[BOS_ID, 8, 9, PAD_ID], [BOS_ID, 10, 11, 12]]
    assert batch["tgt_out"].tolist() == [[8, 9, EOS_ID, PAD_ID], [10, 11, 12, EOS_ID]]
    # Counted on the host for training (no device read): what the padded tensors say.
    assert batch["src_lengths"] == batch["src"].ne(PAD_ID).sum(1).tolist() == [4, 2]
    assert batch["tgt_lengths"] == batch["tgt_out"].ne(PAD_ID).sum(1).tolist() == [3, 4]
    assert batch["target_positions"].tolist() == batch["tgt_out"].ne(PAD_ID).flatten().nonzero().flatten().tolist()


def test_the_loss_with_collates_target_positions_is_the_loss_found_on_the_device():
    """sequence_losses projects the rows collate located on the host, or finds them itself: the same
    loss and gradients, bit for bit."""
    rng = np.random.default_rng(0)
    items = [(rng.integers(4, 23, n), rng.integers(4, 23, m), i) for i, (n, m) in enumerate([(5, 2), (3, 7), (6, 6)])]
    batch = collate(items)
    results = []
    for positions in (batch["target_positions"], None):
        torch.manual_seed(0)
        model = Transformer(tiny_config(dropout=0.1))
        torch.manual_seed(1)
        loss, nll, n = sequence_losses(model, batch["src"], batch["tgt_in"], batch["tgt_out"], 0.1, positions)
        loss.backward()
        results.append((loss, nll, n, [p.grad for p in model.parameters()]))
    (loss_a, nll_a, n_a, grads_a), (loss_b, nll_b, n_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(nll_a, nll_b)
    assert int(n_a) == int(n_b) == sum(batch["tgt_lengths"])
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


# ---------------------------------------------------------------- token buckets


def lengths(n=1001, seed=0):
    rng = np.random.default_rng(seed)
    src = rng.integers(1, 60, n)
    return src, np.clip(src + rng.integers(-5, 6, n), 1, None)


def test_batches_respect_max_tokens_and_cover_the_epoch_once():
    src, tgt = lengths()
    sampler = TokenBucketSampler(src, tgt, max_tokens=300, seed=1)
    batches = list(sampler)
    for b in batches:  # padded size per side, counting EOS / BOS
        assert len(b) * (src[b].max() + 1) <= 300 and len(b) * (tgt[b].max() + 1) <= 300
    assert sorted(i for b in batches for i in b) == list(range(len(src)))
    real = sum(src[b].sum() + tgt[b].sum() for b in batches)  # over both sides, against the padded batches
    assert real / sum(len(b) * (src[b].max() + tgt[b].max()) for b in batches) > 0.9


def greedy_batches(src, tgt, max_tokens):
    """The batch plan sentence by sentence, as written before it walked lengths (the reference): np.lexsort,
    then each sentence joins the open batch unless the batch's padded size would pass max_tokens."""
    order = np.lexsort((src + tgt, np.maximum(src, tgt)))
    batches, start, widest = [], 0, 0
    for i, (s, t) in enumerate(zip(src[order].tolist(), tgt[order].tolist())):
        if i > start and (i - start + 1) * max(widest, s, t) > max_tokens:
            batches.append(order[start:i].tolist())
            start, widest = i, 0
        widest = max(widest, s, t)
    return batches + [order[start:].tolist()]


@pytest.mark.parametrize("max_tokens", [1, 7, 60, 300, 4096])
def test_the_batch_plan_equals_filling_batches_sentence_by_sentence(max_tokens):
    rng = np.random.default_rng(max_tokens)
    src = rng.integers(1, 80, 5000)
    tgt = np.clip(src + rng.integers(-30, 30, 5000), 1, None)
    sampler = TokenBucketSampler(src, tgt, max_tokens, shuffle=False)
    assert [b.tolist() for b in sampler.all_batches(0)] == greedy_batches(src + 1, tgt + 1, max_tokens)
    big = np.array([70000, 3, 70000, 5])  # keys past 16 bits: the plain lexsort, the same plan
    assert [b.tolist() for b in TokenBucketSampler(big, big, 10**6, shuffle=False).all_batches(0)] == (
        greedy_batches(big + 1, big + 1, 10**6)
    )


def test_a_sentence_longer_than_max_tokens_gets_a_batch_of_its_own():
    batches = list(TokenBucketSampler(np.array([3, 50, 4]), np.array([3, 60, 2]), max_tokens=20))
    assert [1] in batches and sorted(i for b in batches for i in b) == [0, 1, 2]


def test_batch_order_is_reshuffled_per_epoch_from_the_seed():
    src, tgt = lengths()
    a, b = TokenBucketSampler(src, tgt, 300, seed=1), TokenBucketSampler(src, tgt, 300, seed=1)
    epoch0 = list(a)
    assert epoch0 == list(b) == list(a)  # same seed, same epoch: same order, pass after pass
    a.set_epoch(1)
    epoch1 = list(a)
    assert epoch1 != epoch0 and sorted(i for x in epoch1 for i in x) == list(range(len(src)))
    b.set_epoch(1)
    assert list(b) == epoch1
    unshuffled = TokenBucketSampler(src, tgt, 300, shuffle=False)
    assert list(unshuffled) == list(unshuffled)


def test_a_shuffled_epoch_cuts_the_same_batches_and_orders_ties_at_random():
    src = np.full(3000, 9)  # one longer side: the totals alone order the sentences
    tgt = np.r_[np.full(1500, 9), np.full(1500, 8)]  # the last 1,500 (total 19 with EOS/BOS) come first
    cuts = sorted(len(b) for b in greedy_batches(src + 1, tgt + 1, 100))
    whole = TokenBucketSampler(src, tgt, max_tokens=10**6, seed=4)  # one batch: the epoch's order itself
    cut = TokenBucketSampler(src, tgt, max_tokens=100, seed=4)
    positions, orders = np.zeros(3000), set()
    for epoch in range(40):
        (order,) = whole.all_batches(epoch)
        assert sorted(order[:1500].tolist()) == list(range(1500, 3000)) and sorted(order[1500:]) == list(range(1500))
        positions[order] += np.r_[np.arange(1500), np.arange(1500)]
        orders.add(tuple(order[:20].tolist()))
        batches = cut.all_batches(epoch)
        assert sorted(len(b) for b in batches) == cuts  # the same cuts as sentence by sentence
        assert all(len(set((tgt[b]).tolist())) == 1 for b in batches)  # sorted apart before cutting
    assert len(orders) == 40  # every epoch its own order
    # A tie's place is uniform: over 40 epochs each sentence's mean place among its 1,500 ties is
    # 749.5 +- 68 (sd), not its index (a stable sort's order).
    mean = positions / 40
    assert mean.min() > 749.5 - 5 * 68 and mean.max() < 749.5 + 5 * 68
    assert abs(np.corrcoef(np.arange(1500), mean[:1500])[0, 1]) < 0.15


@pytest.mark.parametrize("n", [1001, 1002, 37])
def test_two_ranks_draw_disjoint_equal_shares_of_the_whole_epoch(n):
    src, tgt = lengths(n)
    ranks = [TokenBucketSampler(src, tgt, 300, seed=3, rank=r, world_size=2) for r in range(2)]
    for r in ranks:
        r.set_epoch(5)
    shares = [list(r) for r in ranks]
    assert len(shares[0]) == len(shares[1]) == len(ranks[0])
    flat = [[i for b in share for i in b] for share in shares]
    assert not set(flat[0]) & set(flat[1])
    assert sorted(flat[0] + flat[1]) == list(range(n))


def test_sampler_restored_mid_epoch_yields_exactly_the_remaining_batches():
    src, tgt = lengths()
    sampler = TokenBucketSampler(src, tgt, 300, seed=7)
    sampler.set_epoch(2)
    it = iter(sampler)
    seen = [next(it) for _ in range(5)]
    rest = list(it)
    restored = TokenBucketSampler(src, tgt, 300, seed=7)
    restored.load_state_dict({"epoch": 2, "position": 5})  # what ResumableLoader saves after 5 batches
    assert list(restored) == rest and len(seen) + len(rest) == len(sampler)
    assert len(list(restored)) == len(sampler)  # the next pass is whole again


@pytest.mark.parametrize("devices", [1, 2, 7, 8, 32, 64])
def test_the_update_size_is_the_same_on_any_number_of_devices(devices):
    batch_tokens, accumulation = update_shape(25_000, 4096, devices)
    micro_batch = batch_tokens * devices  # one micro-batch on every device
    assert batch_tokens <= 4096 and 25_000 <= accumulation * micro_batch < 25_000 + micro_batch
    assert accumulation == math.ceil(25_000 / (4096 * devices))  # no more micro-batches than max_tokens needs


def test_update_shape_by_hand():
    assert update_shape(25_000, 4096, 1) == (3572, 7)  # 7 x 3,572 = 25,004 (was 7 x 4,096 = 28,672)
    assert update_shape(25_000, 3125, 8) == (3125, 1)  # the paper: 8 GPUs
    assert update_shape(25_000, 4096, 64) == (391, 1)  # 64 x 391 = 25,024
    assert update_shape(None, 4096, 8) == (4096, 1)  # no target: max_tokens per device, no accumulation


# ---------------------------------------------------------------- real data (../shared/data)


@pytest.mark.real_data
@pytest.mark.slow
def test_data_stats_on_multi30k_reports_padding_efficiency_above_90_percent(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "data_stats.py"),
            "data=multi30k",
            f"data.path={SHARED_DATA / 'multi30k'}",
            "data.max_tokens=4096",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]  # no outputs/<date>/<time>/: it trained nothing
    line = next(line for line in out.splitlines() if line.startswith("padding efficiency:"))
    assert float(line.split(":")[1]) >= 0.90, out
    assert "train 29,000" in out and "tokenization: cold" in out and "cached" in out
