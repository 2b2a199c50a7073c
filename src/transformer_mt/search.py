"""Greedy and beam search (§6.1) over the model's cached decoding (encode -> start_decoding -> decode_step), and
translating in length-sorted batches."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor
from tqdm.auto import tqdm

from transformer_mt.decoding import PAPER, Heartbeat
from transformer_mt.decoding_state import DecoderState
from transformer_mt.errors import InputError
from transformer_mt.model import Transformer
from transformer_mt.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, source_batch

Hypotheses = list[tuple[list[int], float]]  # one sentence's n best (tokens without BOS/EOS, score), best first


def start_decoding(model: Transformer, src: Tensor, max_len_a: float, max_len_b: int) -> tuple:
    """The encoder's pass and the decoder's state for a batch: (state, each sentence's length limit, the width of
    the longest output with its EOS)."""
    if model.training:  # dropout would make every translation a draw
        raise ValueError("decoding runs in eval mode: call model.eval() first (translate_ids does)")
    memory, src_pad = model.encode(src)
    # §6.1: at most a x input length + b output tokens before EOS (paper: a = 1, b = 50); the input's EOS not counted
    limits = (max_len_a * (src.ne(PAD_ID).sum(1) - 1) + max_len_b).long().clamp(max=model.cfg.max_positions - 1)
    return model.start_decoding(memory, src_pad), limits, int(limits.max()) + 1


@torch.inference_mode()
def greedy(model: Transformer, src: Tensor, max_len_a: float = PAPER.max_len_a, max_len_b: int = PAPER.max_len_b):
    """Arg-max decoding; returns each sentence's tokens without BOS/EOS. Finished sentences leave the batch."""
    state, limits, width = start_decoding(model, src, max_len_a, max_len_b)
    alive = torch.arange(src.size(0), device=src.device)  # original index of each sentence still decoding
    prev = torch.full_like(alive, BOS_ID)
    tokens = torch.full((src.size(0), width), PAD_ID, dtype=torch.long, device=src.device)
    for t in range(width):
        logits = model.decode_step(prev, state)
        logits[:, PAD_ID] = -torch.inf  # padding is never an output
        prev = torch.where(t >= limits[alive], EOS_ID, logits.argmax(-1))
        tokens[alive, t] = prev
        done = prev.eq(EOS_ID)
        stopped = int(done.sum())  # the step's one wait for the device
        if stopped == alive.size(0):
            break
        if stopped:
            keep = (~done).nonzero().squeeze(1)
            alive, prev = alive[keep], prev[keep]
            state.select(keep, sentences=keep)
    return [[i for i in row if i not in (EOS_ID, PAD_ID)] for row in tokens.tolist()]


def length_penalty(length: Tensor | int, alpha: float, kind: str = PAPER.length_penalty) -> Tensor:
    """The divisor of a hypothesis' log-probability; |Y| counts the EOS. "gnmt" (Wu et al., 2016; §6.1):
    ((5 + |Y|) / 6)^alpha; "fairseq" (its --lenpen): |Y|^alpha."""
    length = torch.as_tensor(length, dtype=torch.float32)
    return (length if kind == "fairseq" else (5.0 + length) / 6.0) ** alpha


def next_token_logprobs(model: Transformer, prev: Tensor, state: DecoderState, at_limit: Tensor | None) -> Tensor:
    """One decoding step: float32 log P(token) (n*K, V), normalised over the whole vocabulary, then PAD excluded
    (-inf) and, where `at_limit` (n*K,) is True (None: nowhere), every token but EOS."""
    logprobs = model.decode_step(prev, state).log_softmax(-1, dtype=torch.float32)
    logprobs[:, PAD_ID] = -torch.inf
    if at_limit is not None and at_limit.any():
        eos = torch.arange(logprobs.size(1), device=logprobs.device) == EOS_ID
        logprobs[at_limit] = torch.where(eos, logprobs[at_limit], -torch.inf)
    return logprobs


def gather_hypotheses(tokens: Tensor, index: Tensor) -> Tensor:
    """(n, K, width) tokens, (n, k) hypothesis numbers -> the (n, k, width) tokens of those hypotheses, a copy."""
    return tokens.gather(1, index[..., None].expand(-1, -1, tokens.size(2)))


def best_candidates(logprobs: Tensor, alive_scores: Tensor, C: int) -> tuple[Tensor, Tensor, Tensor]:
    """The best C continuations of each sentence's k live hypotheses: (scores, beam, token), each (n, C), best first.
    logprobs (n*k, V) log P of each next token; alive_scores (n, k) log P of each hypothesis. The best C of all
    k * V candidates are among each hypothesis' own best C tokens: rank those, not the whole (k * V) table."""
    n, k = alive_scores.shape
    C = min(C, logprobs.size(1))
    row_logprobs, row_tokens = logprobs.topk(C, dim=1)  # (n*k, C)
    cand = (alive_scores.view(-1, 1) + row_logprobs).view(n, k * C)
    top_scores, top_idx = cand.topk(C, dim=1)
    return top_scores, top_idx // C, row_tokens.view(n, k * C).gather(1, top_idx)


@dataclass
class Finished:
    """The best K finished hypotheses of every sentence, best first."""

    scores: Tensor  # (B, K) normalised scores, -inf: none
    tokens: Tensor  # (B, K, width), EOS included, PAD after it

    def add(self, sentences: Tensor, scores: Tensor, tokens: Tensor) -> Tensor:
        """Merge candidates (n, C), (n, C, width) of the original sentences `sentences` (n,) into their best K;
        returns those sentences' new scores (n, K)."""
        merged_scores = torch.cat([self.scores[sentences], scores], dim=1)
        merged_tokens = torch.cat([self.tokens[sentences], tokens], dim=1)
        best, pick = merged_scores.topk(self.scores.size(1), dim=1)
        self.scores[sentences] = best
        self.tokens[sentences] = gather_hypotheses(merged_tokens, pick)
        return best

    def nbest(self, n_best: int) -> list[Hypotheses]:
        """Each sentence's n_best (tokens without EOS/PAD, score), best first."""
        lists = []
        for scores, tokens in zip(self.scores.tolist(), self.tokens.tolist()):
            found = [(seq, score) for seq, score in zip(tokens, scores) if score > -torch.inf]
            lists.append([([i for i in seq if i not in (EOS_ID, PAD_ID)], score) for seq, score in found[:n_best]])
        return lists


@dataclass
class Searching:
    """The sentences still searching, kept in step as sentences leave the batch: each one's original index, maximum
    length and live hypotheses, the score of its n_best-th finished hypothesis (floor; -inf while it has fewer) and
    the length penalty at its maximum length (ceiling): a live hypothesis can score at most log P / ceiling, its
    log P only falls."""

    ids: Tensor  # (n,)
    limits: Tensor  # (n,)
    scores: Tensor  # (n, k) log P: one hypothesis (BOS) at step 0, then K
    tokens: Tensor  # (n, k, width)
    floors: Tensor  # (n,)
    ceilings: Tensor  # (n,)

    @classmethod
    def start(cls, limits: Tensor, penalty: Callable[[Tensor | int], Tensor], width: int) -> Searching:
        B, device = limits.size(0), limits.device
        tokens = torch.full((B, 1, width), PAD_ID, dtype=torch.long, device=device)
        floors = torch.full((B,), -torch.inf, device=device)
        return cls(
            torch.arange(B, device=device),
            limits,
            torch.zeros((B, 1), device=device),
            tokens,
            floors,
            penalty(limits + 1),
        )

    def done(self) -> Tensor:
        """(n,) True where no live hypothesis can beat the n_best-th finished one (the best live one, ending at the
        maximum length, would score best / ceiling at most)."""
        return self.floors >= self.scores[:, 0] / self.ceilings

    def continued(self, parent: Tensor, token: Tensor, t: int) -> Tensor:
        """The tokens (n, k', width) of the live hypotheses `parent` (n, k') continued by `token` (n, k') at t."""
        tokens = gather_hypotheses(self.tokens, parent)
        tokens[:, :, t] = token
        return tokens

    def keep(self, index: Tensor) -> None:
        """Only the sentences `index` (n',) go on searching, in that order."""
        kept = (x[index] for x in (self.ids, self.limits, self.scores, self.tokens))
        self.ids, self.limits, self.scores, self.tokens = kept
        self.floors, self.ceilings = self.floors[index], self.ceilings[index]


@torch.inference_mode()
def beam_search(
    model: Transformer,
    src: Tensor,
    beam_size: int = PAPER.beam_size,
    alpha: float = PAPER.alpha,
    max_len_a: float = PAPER.max_len_a,
    max_len_b: int = PAPER.max_len_b,
    n_best: int = 1,
    length_penalty_kind: str = PAPER.length_penalty,
) -> list[Hypotheses]:
    """§6.1 beam search, vectorised over sentences and beams; the first step once per sentence, from BOS, before
    the beam expands to K. A hypothesis Y scores log P(Y) / length_penalty(|Y|). A sentence stops when its n_best-th
    best finished hypothesis beats the best any live one could reach (its log-probability only falls, its penalty
    is at most that of the maximum length), so the n best it returns are those of a search that never stops early;
    or at the maximum length, where EOS is forced. Finished sentences leave the batch. Returns each sentence's
    n_best (tokens without BOS/EOS, score), best first; n_best <= beam_size."""
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best={n_best}: must be between 1 and the beam size {beam_size}")
    B, K, device = src.size(0), beam_size, src.device
    state, limits, width = start_decoding(model, src, max_len_a, max_len_b)  # B rows; B * K after step 0
    penalty = partial(length_penalty, alpha=alpha, kind=length_penalty_kind)
    alive = Searching.start(limits, penalty, width)
    prev = torch.full((B,), BOS_ID, dtype=torch.long, device=device)
    finished = Finished(torch.full((B, K), -torch.inf, device=device), alive.tokens.new_full((B, K, width), PAD_ID))
    soonest = int(limits.min())  # the first step at which a sentence still searching must end

    for t in range(width):
        n, k = alive.scores.shape
        at_limit = (t >= alive.limits).repeat_interleave(k) if t >= soonest else None  # EOS forced there
        logprobs = next_token_logprobs(model, prev, state, at_limit)  # (n*k, V)
        top_scores, beam, token = best_candidates(logprobs, alive.scores, 2 * K)  # 2K: at most K end in EOS
        ends = token.eq(EOS_ID)

        # Finished: EOS candidates among the top K (as a beam of K would take them; so beam 1 is greedy), merged
        # with those kept so far, the best K kept; most steps end none.
        if ends[:, :K].any():  # the floors follow: each sentence's n_best-th finished score
            normalised = (top_scores[:, :K] / penalty(t + 1)).masked_fill(~ends[:, :K], -torch.inf)
            history = alive.continued(beam[:, :K], token[:, :K], t)
            alive.floors = finished.add(alive.ids, normalised, history)[:, n_best - 1]

        # Alive: the best K candidates that did not end.
        alive.scores, pick = top_scores.masked_fill(ends, -torch.inf).topk(K, dim=1)
        parent, prev = beam.gather(1, pick), token.gather(1, pick)  # (n, K): the hypothesis each extends, how
        alive.tokens = alive.continued(parent, prev, t)
        rows = (parent + torch.arange(0, n * k, k, device=device)[:, None]).view(-1)  # (n*K,) of n*k
        prev = prev.view(-1)
        done = alive.done()
        stopped = int(done.sum())  # a wait for the device, as ends.any() above: two a step
        if stopped == n:
            break
        if stopped:  # drop finished sentences (and their encoder states) from the batch
            keep = (~done).nonzero().squeeze(1)
            alive.keep(keep)
            soonest = int(alive.limits.min())
            state.select(rows.view(n, K)[keep].view(-1), sentences=keep)
            prev = prev.view(n, K)[keep].view(-1)
        else:  # rows only permute (or, after step 0, expand) the beams of each sentence: encoder states stay
            state.select(rows)
    return finished.nbest(n_best)


def translate_ids(
    model: Transformer,
    sources: list,
    beam_size: int = 1,
    alpha: float = PAPER.alpha,
    max_len_a: float = PAPER.max_len_a,
    max_len_b: int = PAPER.max_len_b,
    tokens_per_batch: int = 16384,
    progress: bool = False,
    n_best: int = 0,
    report: Callable[[str], None] | None = None,
    length_penalty: str = PAPER.length_penalty,
) -> list:
    """Translate token-id sequences in length-sorted batches; results come back in input order: each sentence's
    best tokens, or with n_best=K > 0 its K best (tokens, score) pairs, best first (K <= beam_size).
    A batch holds at most `tokens_per_batch` source tokens counted over all beams (sentences x beam x longest).
    `progress` shows a bar of translated sentences on stderr; `report` gets a line at least every minute (a log's)."""
    if n_best > beam_size:
        raise InputError(f"n_best={n_best} exceeds the beam size {beam_size}: set decoding.beam_size={n_best} or more")
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    results: list = [[] for _ in sources]
    device = next(model.parameters()).device
    was_training = model.training
    if was_training:
        model.eval()
    every = 1 if sys.stderr.isatty() else 30  # seconds between updates of the bar; in a log file, a line each
    bar = tqdm(
        total=len(sources), desc="translating", unit="sentence", disable=not progress, leave=False, mininterval=every
    )
    start, heartbeat = 0, Heartbeat(report, len(sources))
    while start < len(order):
        end = start + 1  # grow the batch while (sentences x beam x longest) fits tokens_per_batch
        while end < len(order) and (end - start + 1) * beam_size * (len(sources[order[end]]) + 1) <= tokens_per_batch:
            end += 1
        src = source_batch([sources[i] for i in order[start:end]], device)
        if beam_size == 1 and not n_best:
            hyps = greedy(model, src, max_len_a, max_len_b)
        else:
            hyps = beam_search(model, src, beam_size, alpha, max_len_a, max_len_b, max(n_best, 1), length_penalty)
            hyps = hyps if n_best else [nbest[0][0] for nbest in hyps]
        for i, hyp in zip(order[start:end], hyps):
            results[i] = hyp
        bar.update(end - start)
        heartbeat(end)
        start = end
    bar.close()
    if was_training:
        model.train()
    return results


def translate_lines(
    model: Transformer, tokenizer: Tokenizer, lines: list[str], warn=None, first_line: int = 1, **decoding
) -> list:
    """Text in, text out, same order: the contract of every engine (evaluation/engines.py). Empty lines stay empty;
    inputs longer than the model's positions are truncated, calling `warn(message)` for each (lines numbered from
    first_line). decoding: translate_ids' options; with n_best=K, each line gives its K best (text, score) pairs."""
    limit = model.cfg.max_positions - 1  # room for EOS
    sources = tokenizer.encode([line.strip() for line in lines])
    for i, ids in enumerate(sources):
        if len(ids) > limit:
            if warn:
                warn(f"line {first_line + i}: {len(ids)} tokens, truncated to the model's maximum of {limit}")
            sources[i] = ids[:limit]
    todo = [i for i, ids in enumerate(sources) if ids]
    results = translate_ids(model, [sources[i] for i in todo], **decoding)
    if decoding.get("n_best"):  # each line: its K best (text, score), best first; an empty line: ("", 0.0)
        outputs = [[("", 0.0)] for _ in lines]
        for i, hyps in zip(todo, results):
            outputs[i] = list(zip(tokenizer.decode([ids for ids, _ in hyps]), [score for _, score in hyps]))
        return outputs
    outputs = [""] * len(lines)
    for i, text in zip(todo, tokenizer.decode(results)):
        outputs[i] = text
    return outputs
