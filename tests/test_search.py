"""Greedy and beam search against recomputation without the cache (§6.1)."""

import random

import pytest
import torch

from conftest import tiny_config
from transformer_mt.decoding import Heartbeat
from transformer_mt.model import Transformer
from transformer_mt.runtime import compile_decoding
from transformer_mt.search import beam_search, greedy, length_penalty, translate_ids
from transformer_mt.tokenizer import BOS_ID, EOS_ID, PAD_ID, source_batch

SOURCES = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17]]


def trained_like_model(seed: int) -> Transformer:
    """A random tiny model whose EOS logit is raised, so hypotheses end at varied lengths; for inference, as
    load_for_inference gives it (no gradients)."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(vocab_size=30, max_positions=128, dropout=0.0)).eval().requires_grad_(False)
    with torch.no_grad():
        model.embed.tokens.weight[EOS_ID] *= 3
    return model


def sequence_logprob(model: Transformer, src_row: torch.Tensor, tokens: list[int]) -> float:
    """log P(tokens + EOS | src) from one full forward pass, no cache."""
    tgt_in = torch.tensor([[BOS_ID, *tokens]])
    tgt_out = torch.tensor([[*tokens, EOS_ID]])
    with torch.no_grad():
        logp = torch.log_softmax(model(src_row[None], tgt_in).float(), -1)
    return logp.gather(-1, tgt_out[..., None]).sum().item()


def search(model, src, beam_size=4, alpha=0.6, max_len_a=1.0, max_len_b=50, n_best=1, kind="gnmt"):
    """beam_search: (each sentence's best tokens, its n-best list)."""
    nbest = beam_search(model, src, beam_size, alpha, max_len_a, max_len_b, n_best, kind)
    return [hyps[0][0] for hyps in nbest], nbest


def reference_beam_search(
    model: Transformer, source: list[int], K: int, alpha: float, max_len_b: int, n_best: int, kind: str = "gnmt"
):
    """§6.1 beam search for one sentence, written plainly: Python lists and a full forward pass
    (no cache, no batching) for each live hypothesis at each step. Rules as documented in
    search.beam_search: each step ranks every (hypothesis, token) continuation; among the best 2K,
    those ending in EOS within the first K finish (score = log P / length penalty), the best K others
    live on; EOS is forced at the maximum length; the search stops when the n_best-th finished
    hypothesis beats the best any live one could reach, log P / penalty(maximum length + 1)."""
    src = source_batch([source])
    limit = len(source) + max_len_b
    alive, finished = [([], 0.0)], []  # (tokens, log P); (tokens, normalised score)
    for t in range(limit + 1):
        candidates = []
        for tokens, logp in alive:
            with torch.no_grad():
                step = torch.log_softmax(model(src, torch.tensor([[BOS_ID, *tokens]]))[0, -1].double(), -1)
            for token, token_logp in enumerate(step.tolist()):
                if token != PAD_ID and (t < limit or token == EOS_ID):
                    candidates.append((tokens + [token], logp + token_logp))
        top = sorted(candidates, key=lambda c: -c[1])[: 2 * K]
        for rank, (tokens, logp) in enumerate(top):
            if tokens[-1] == EOS_ID and rank < K:
                finished.append((tokens[:-1], logp / length_penalty(len(tokens), alpha, kind).item()))
        finished = sorted(finished, key=lambda f: -f[1])[:K]
        alive = [(tokens, logp) for tokens, logp in top if tokens[-1] != EOS_ID][:K]
        bound = alive[0][1] / length_penalty(limit + 1, alpha, kind).item() if alive else -float("inf")
        if len(finished) >= n_best and finished[n_best - 1][1] >= bound:
            break
    return finished[:n_best]


@pytest.mark.parametrize(
    "seed, beam, alpha, kind",
    [(0, 4, 0.6, "gnmt"), (1, 4, 0.0, "gnmt"), (2, 2, 0.6, "gnmt"), (3, 3, 1.0, "gnmt"), (4, 5, 1.0, "fairseq")],
)
def test_batched_cached_beam_search_equals_a_plain_reference(seed, beam, alpha, kind):
    """Same n-best (tokens and scores) as the plain search, for the 1-best (which may stop sooner)
    and for the whole beam."""
    model, src = trained_like_model(seed), source_batch(SOURCES)
    for n_best in (1, beam):
        best, nbest = search(model, src, beam_size=beam, alpha=alpha, max_len_b=8, n_best=n_best, kind=kind)
        for row, source in enumerate(SOURCES):
            expected = reference_beam_search(model, source, beam, alpha, 8, n_best, kind)
            assert [tokens for tokens, _ in nbest[row]] == [tokens for tokens, _ in expected]
            assert [score for _, score in nbest[row]] == pytest.approx([score for _, score in expected], abs=1e-4)
            assert best[row] == expected[0][0]


@pytest.mark.parametrize("seed", range(4))
def test_beam_of_one_equals_greedy(seed):
    model, src = trained_like_model(seed), source_batch(SOURCES)
    assert search(model, src, beam_size=1, alpha=0.0, max_len_b=10)[0] == greedy(model, src, max_len_b=10)


@pytest.mark.parametrize("seed, kind", [(0, "gnmt"), (1, "gnmt"), (2, "gnmt"), (3, "fairseq")])
def test_scores_equal_length_penalised_recomputed_logprobs_and_nbest_is_sorted(seed, kind):
    model, src = trained_like_model(seed), source_batch(SOURCES)
    best, nbest = search(model, src, beam_size=4, alpha=0.6, max_len_b=10, n_best=4, kind=kind)
    for row, hyps in enumerate(nbest):
        assert 1 <= len(hyps) <= 4 and best[row] == hyps[0][0]
        scores = [score for _, score in hyps]
        assert scores == sorted(scores, reverse=True)
        for tokens, score in hyps:
            expected = sequence_logprob(model, src[row], tokens) / length_penalty(len(tokens) + 1, 0.6, kind).item()
            assert score == pytest.approx(expected, abs=1e-4)


def test_length_penalty_is_the_gnmt_formula_or_fairseqs_length_power():
    assert length_penalty(1, 0.6).item() == pytest.approx(1.0)
    assert length_penalty(11, 0.6).item() == pytest.approx((16 / 6) ** 0.6)
    assert length_penalty(30, 0.0).item() == 1.0
    assert length_penalty(11, 1.0, "fairseq").item() == 11.0  # --lenpen 1: the mean log-probability per token
    assert length_penalty(11, 0.6, "fairseq").item() == pytest.approx(11**0.6)


@pytest.mark.parametrize("seed, alpha, kind", [(0, 1.0, "fairseq"), (1, 0.5, "fairseq"), (2, 0.6, "gnmt")])
def test_beam_search_ranks_every_output_as_a_brute_force_search_does(seed, alpha, kind):
    """Brute force: every output of at most 1 token (then EOS) over a 6-word vocabulary, 5 in all, scored from a full
    forward pass as log P / length penalty. A beam of 5 keeps all of them (PAD is never an output), so its 5 best
    must be all 5, in the brute force's order, with its scores: outputs of 1 and 2 tokens ranked by the penalty."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(vocab_size=6, max_positions=16, dropout=0.0)).eval().requires_grad_(False)
    src = source_batch([[4, 5, 1]])
    outputs = [[]] + [[w] for w in range(6) if w not in (PAD_ID, EOS_ID)]
    scores = [sequence_logprob(model, src[0], ys) / length_penalty(len(ys) + 1, alpha, kind).item() for ys in outputs]
    best = sorted(zip(scores, outputs), key=lambda pair: -pair[0])
    _, nbest = search(model, src, beam_size=5, alpha=alpha, max_len_a=0.0, max_len_b=1, n_best=5, kind=kind)
    assert [tokens for tokens, _ in nbest[0]] == [ys for _, ys in best]
    assert [score for _, score in nbest[0]] == pytest.approx([score for score, _ in best], abs=1e-5)


def test_beam_is_no_worse_than_greedy_under_its_own_objective():
    model, src = trained_like_model(1), source_batch(SOURCES)
    _, nbest = search(model, src, beam_size=4, alpha=0.0, max_len_b=10)
    for row, tokens in enumerate(greedy(model, src, max_len_b=10)):
        assert nbest[row][0][1] >= sequence_logprob(model, src[row], tokens) - 1e-4


def test_a_sentence_alone_equals_it_inside_a_padded_batch():
    model = trained_like_model(2)
    batch_best, batch_nbest = search(model, source_batch(SOURCES), beam_size=4, max_len_b=10, n_best=3)
    for row, source in enumerate(SOURCES):
        best, nbest = search(model, source_batch([source]), beam_size=4, max_len_b=10, n_best=3)
        assert best[0] == batch_best[row]
        assert [t for t, _ in nbest[0]] == [t for t, _ in batch_nbest[row]]
        assert [s for _, s in nbest[0]] == pytest.approx([s for _, s in batch_nbest[row]], abs=1e-4)


def test_cached_and_uncached_decoding_choose_the_same_tokens():
    model, src = trained_like_model(3), source_batch(SOURCES)
    cached = greedy(model, src, max_len_b=10)
    for row, tokens in enumerate(cached):  # redo greedy with a full forward pass per step
        prefix = [BOS_ID]
        with torch.no_grad():
            for _ in range(len(tokens) + 1):
                logits = model(src[row][None], torch.tensor([prefix]))[0, -1]
                logits[PAD_ID] = -torch.inf
                prefix.append(int(logits.argmax()))
        assert prefix[1:-1] == tokens
        if len(tokens) < len(SOURCES[row]) + 10:  # ended by choice, not by the length limit
            assert prefix[-1] == EOS_ID


@pytest.mark.parametrize("a, b", [(1.0, 3), (0.0, 2), (2.0, 0)])
def test_outputs_respect_the_maximum_length(a, b):
    torch.manual_seed(0)
    model = Transformer(tiny_config(vocab_size=30, max_positions=128)).eval()
    with torch.no_grad():
        model.embed.tokens.weight[EOS_ID] = -10 * model.embed.tokens.weight[7]  # EOS never wins on its own
    src = source_batch(SOURCES)
    for hyps in (greedy(model, src, a, b), search(model, src, 3, 0.6, a, b)[0]):
        for source, tokens in zip(SOURCES, hyps):
            assert len(tokens) <= a * len(source) + b


def test_translate_ids_restores_input_order_across_batches():
    model = trained_like_model(0)
    sources = SOURCES * 3
    one_batch = translate_ids(model, sources, beam_size=2, max_len_b=8, tokens_per_batch=10_000)
    many_batches = translate_ids(model, sources, beam_size=2, max_len_b=8, tokens_per_batch=8)
    assert one_batch == many_batches and one_batch[:4] == one_batch[4:8]


def test_a_long_decode_reports_how_far_it_got_once_a_minute(monkeypatch):
    """`report` gets "<done> of <all> sentences decoded" once Heartbeat.EVERY seconds have passed (a log's line
    at least once a minute, issue 57); here every batch is past it, and the last says nothing (the caller's line)."""
    model, said = trained_like_model(0), []
    monkeypatch.setattr(Heartbeat, "EVERY", 0.0)
    translate_ids(model, SOURCES * 3, beam_size=2, max_len_b=8, tokens_per_batch=8, report=said.append)
    done = [int(line.split()[0]) for line in said]
    assert len(said) >= 3 and done == sorted(done) and done[-1] < 12
    assert all(line.endswith(" of 12 sentences decoded") for line in said)
    monkeypatch.setattr(Heartbeat, "EVERY", 3600.0)
    translate_ids(model, SOURCES * 3, beam_size=2, max_len_b=8, tokens_per_batch=8, report=said.append)
    assert len(said) == len(done)  # within the hour: no line


@pytest.mark.slow  # compiles (~1 min on 2 CPU cores)
def test_compiled_decoding_chooses_eagers_tokens_and_scores():
    """compile=true (runtime.compile_decoding): greedy, beam search and its n-best lists as eager gives
    them, over batches whose shapes change (sentences finish and leave, caches grow, one sentence alone)."""
    sources = SOURCES * 3 + [[5, 9, 11, 17, 6, 10, 12, 7]]
    runs = []
    for compiled in (False, True):
        model = trained_like_model(3)
        if compiled:
            assert compile_decoding(model) is model and model.decode_step is not Transformer.decode_step
        runs.append(
            [
                translate_ids(model, sources, beam_size=1, max_len_b=12),
                translate_ids(model, sources, beam_size=4, max_len_b=12, tokens_per_batch=64),
                translate_ids(model, sources[:1], beam_size=4, max_len_b=12),
                translate_ids(model, sources, beam_size=4, max_len_b=12, n_best=3),
            ]
        )
    eager, compiled = runs
    assert compiled[:3] == eager[:3] and len({tuple(t) for t in eager[1]}) >= 4
    for eager_list, compiled_list in zip(eager[3], compiled[3], strict=True):
        assert [tokens for tokens, _ in compiled_list] == [tokens for tokens, _ in eager_list]
        assert [score for _, score in compiled_list] == pytest.approx([score for _, score in eager_list], abs=1e-4)
    weights = trained_like_model(3).state_dict()
    model = compile_decoding(trained_like_model(3))
    assert model.state_dict().keys() == weights.keys()  # checkpoints of a compiled model are eager's


@pytest.mark.slow  # compiles (~1 min on 2 CPU cores)
def test_the_compiled_step_compiles_a_handful_of_graphs_not_one_per_length_bucket():
    """compile=true: batches of new source lengths and sizes (make evaluate's length-sorted buckets) decode eager's
    tokens and reuse the graphs the first two compiled: encode, the first step and later steps; a batch of one
    sentence and greedy's batch without a beam each add a few (dynamo specializes a size of 1), then nothing."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    torch._dynamo.reset()
    counters.clear()
    model, eager, rng = compile_decoding(trained_like_model(3)), trained_like_model(3), random.Random(0)
    graphs = []
    for length, size in [(3, 4), (5, 7), (8, 3), (12, 6), (17, 2), (23, 5), (30, 4), (40, 3), (50, 8)]:
        batch = [[rng.randrange(5, 30) for _ in range(length)] for _ in range(size)]
        decoded = translate_ids(model, batch, beam_size=4, max_len_b=10)
        assert decoded == translate_ids(eager, batch, beam_size=4, max_len_b=10)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] <= 8 and graphs[-1] == graphs[1], graphs  # 7 more buckets: no graph more
    translate_ids(model, [[5, 9, 11]], beam_size=4, max_len_b=10)
    translate_ids(model, [[5, 9, 11], [7, 8]], beam_size=1, max_len_b=10)
    one_and_greedy = counters["stats"]["unique_graphs"]
    translate_ids(model, [[6, 7, 8, 9]], beam_size=4, max_len_b=10)
    translate_ids(model, [[5, 9, 11, 12, 13, 14], [7, 8, 9]], beam_size=1, max_len_b=10)
    assert one_and_greedy <= graphs[-1] + 8 and counters["stats"]["unique_graphs"] == one_and_greedy, one_and_greedy


def test_decoding_a_model_in_training_mode_is_refused():
    """A model left in training mode would decode through dropout: each translation a draw."""
    model = trained_like_model(0).train()
    for decode in (greedy, beam_search):
        with pytest.raises(ValueError, match=r"eval mode: call model.eval\(\) first"):
            decode(model, source_batch(SOURCES))
    assert translate_ids(model, SOURCES, beam_size=2) and model.training  # translate_ids switches to eval and back
