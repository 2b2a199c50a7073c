"""Decoding over the model's cached API (encode -> start_decoding -> decode_step)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from transformer_mt.decoding import PAPER, check_lookahead
from transformer_mt.decoding_state import DecoderState, decoding_weights
from transformer_mt.errors import InputError
from transformer_mt.model import Transformer
from transformer_mt.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer


def padded(rows: Sequence[Sequence[int]], prefix: Sequence[int] = (), suffix: Sequence[int] = ()) -> Tensor:
    """(B, longest + extras) int64 ids: each row as prefix + row + suffix, right-padded with PAD_ID."""
    width = max(map(len, rows)) + len(prefix) + len(suffix)
    out = np.full((len(rows), width), PAD_ID, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(prefix)] = prefix
        out[i, len(prefix) : len(prefix) + len(row)] = row
        out[i, len(prefix) + len(row) : len(prefix) + len(row) + len(suffix)] = suffix
    return torch.from_numpy(out)


def source_batch(sources: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> Tensor:
    """Source ids -> (B, S) ids + EOS, right-padded: the encoder's input in training and decoding alike."""
    return padded(sources, suffix=[EOS_ID]).to(device)


def max_output_lengths(src: Tensor, a: float = PAPER.max_len_a, b: int = PAPER.max_len_b) -> Tensor:
    """§6.1: at most a * input length + b output tokens before EOS (paper: a = 1, b = 50).

    src rows are ids + EOS + padding (source_batch's layout); the EOS is not counted.
    """
    return (a * (src.ne(PAD_ID).sum(1) - 1) + b).long()


CAPACITY_STEP = 64  # constant shapes: a cache holds a multiple of this many positions (few shapes to compile)


def start_decoding(model: Transformer, src: Tensor, max_len_a: float, max_len_b: int) -> tuple:
    """The encoder's pass and the decoder's state for a batch: (state, each sentence's length limit, the width of
    the longest output with its EOS). With model.constant_shapes the cache holds that width, rounded up."""
    if model.training:  # the layers' steps through decoding's copies apply no dropout (decoding_state.py)
        raise ValueError("decoding runs in eval mode: call model.eval() first (translate_ids does)")
    eager = not model.compiled_decoding  # a compiled step multiplies by plain copies; a compiled encode takes none
    copies = decoding_weights(model, pack=eager, encoder=eager)
    memory, src_pad = model.encode(src, copies.encoder if eager else None)
    limits = max_output_lengths(src, max_len_a, max_len_b).clamp(max=model.cfg.max_positions - 1)
    width = int(limits.max()) + 1
    capacity = -(-width // CAPACITY_STEP) * CAPACITY_STEP if model.constant_shapes else None
    return model.start_decoding(memory, src_pad, capacity, copies), limits, width


@torch.inference_mode()
def greedy(
    model: Transformer, src: Tensor, max_len_a: float = PAPER.max_len_a, max_len_b: int = PAPER.max_len_b
) -> list[list[int]]:
    """Arg-max decoding; returns each sentence's tokens without BOS/EOS. Finished sentences leave the batch (with
    model.constant_shapes they stay, fed PAD, their outputs not kept)."""
    state, limits, width = start_decoding(model, src, max_len_a, max_len_b)
    alive = torch.arange(src.size(0), device=src.device)  # original index of each sentence still decoding
    prev = torch.full_like(alive, BOS_ID)
    ended = torch.zeros_like(alive, dtype=torch.bool)  # constant shapes: the sentences that ended, still there
    tokens = torch.full((src.size(0), width), PAD_ID, dtype=torch.long, device=src.device)
    for t in range(width):
        logits = model.decode_step(prev, state)
        logits[:, PAD_ID] = -torch.inf  # padding is never an output
        prev = torch.where(t >= limits[alive], EOS_ID, logits.argmax(-1))
        if model.constant_shapes:  # a sentence that ended stays, fed PAD; its outputs are not kept
            prev = torch.where(ended, PAD_ID, prev)
        tokens[alive, t] = prev
        done = ended = prev.eq(EOS_ID) | ended if model.constant_shapes else prev.eq(EOS_ID)
        stopped = int(done.sum())  # the step's one wait for the device
        if stopped == alive.size(0):
            break
        if stopped and not model.constant_shapes:
            keep = (~done).nonzero().squeeze(1)
            alive, prev = alive[keep], prev[keep]
            state.select(keep, sentences=keep)
    return [[i for i in row if i not in (EOS_ID, PAD_ID)] for row in tokens.tolist()]


def length_penalty(length: Tensor | int, alpha: float) -> Tensor:
    """GNMT (Wu et al., 2016) length penalty ((5 + |Y|) / 6)^alpha; |Y| counts the EOS (theirs: decoding.py)."""
    return ((5.0 + torch.as_tensor(length, dtype=torch.float32)) / 6.0) ** alpha


def next_token_logprobs(model: Transformer, prev: Tensor, state: DecoderState, at_limit: Tensor | None) -> Tensor:
    """One decoding step: float32 log P(token) (n*K, V), normalised over the whole vocabulary, then PAD excluded
    (-inf) and, where `at_limit` (n*K,) is True (None: nowhere), every token but EOS."""
    logprobs = model.decode_step(prev, state).log_softmax(-1, dtype=torch.float32)  # one pass
    logprobs[:, PAD_ID] = -torch.inf
    if at_limit is not None and at_limit.any():  # rarely: a step's mask, not a pass over every row's logits
        eos = torch.arange(logprobs.size(1), device=logprobs.device) == EOS_ID
        logprobs[at_limit] = torch.where(eos, logprobs[at_limit], -torch.inf)
    return logprobs


def gather_hypotheses(tokens: Tensor, index: Tensor) -> Tensor:
    """(n, K, width) tokens, (n, k) hypothesis numbers -> the (n, k, width) tokens of those hypotheses, a copy."""
    return tokens.gather(1, index[..., None].expand(-1, -1, tokens.size(2)))


def best_candidates(logprobs: Tensor, alive_scores: Tensor, C: int) -> tuple[Tensor, Tensor, Tensor]:
    """The best C continuations of each sentence's k live hypotheses: (scores, beam, token), each (n, C), best first.

    logprobs (n*k, V) log P of each next token; alive_scores (n, k) log P of each hypothesis.
    The best C of all k * V candidates are among each hypothesis' own best C tokens: rank those
    (k * C per sentence), not the whole (k * V) table.
    """
    n, k = alive_scores.shape
    C = min(C, logprobs.size(1))
    row_logprobs, row_tokens = logprobs.topk(C, dim=1)  # (n*k, C)
    cand = (alive_scores.view(-1, 1) + row_logprobs).view(n, k * C)
    top_scores, top_idx = cand.topk(C, dim=1)
    return top_scores, top_idx // C, row_tokens.view(n, k * C).gather(1, top_idx)


@dataclass
class Finished:
    """The best K finished hypotheses of every sentence, best first: normalised scores (-inf: none) and tokens."""

    scores: Tensor  # (B, K)
    tokens: Tensor  # (B, K, width), EOS included, PAD after it

    @classmethod
    def empty(cls, B: int, K: int, width: int, device: torch.device) -> Finished:
        return cls(
            torch.full((B, K), -torch.inf, device=device),
            torch.full((B, K, width), PAD_ID, dtype=torch.long, device=device),
        )

    def add(self, sentences: Tensor, scores: Tensor, tokens: Tensor) -> Tensor:
        """Merge candidates (n, C), (n, C, width) of the original sentences `sentences` (n,) into their best K;
        returns those sentences' new scores (n, K)."""
        merged_scores = torch.cat([self.scores[sentences], scores], dim=1)
        merged_tokens = torch.cat([self.tokens[sentences], tokens], dim=1)
        best, pick = merged_scores.topk(self.scores.size(1), dim=1)
        self.scores[sentences] = best
        self.tokens[sentences] = gather_hypotheses(merged_tokens, pick)
        return best

    def nbest(self, n_best: int) -> list[list[tuple[list[int], float]]]:
        """Each sentence's n_best (tokens without EOS/PAD, score), best first."""
        lists = []
        for scores, tokens in zip(self.scores.tolist(), self.tokens.tolist()):
            hyps = [
                ([i for i in seq if i not in (EOS_ID, PAD_ID)], sc)
                for seq, sc in zip(tokens, scores)
                if sc > -torch.inf
            ]
            lists.append(hyps[:n_best])
        return lists


@dataclass
class Searching:
    """The sentences still searching, kept in step as sentences leave the batch: each one's original index, maximum
    length and live hypotheses, and per alpha the score of its n_best-th finished hypothesis (floor; -inf while it
    has fewer) and the length penalty at its maximum length (ceiling): a live hypothesis can score at most
    log P / ceiling, its log P only falls."""

    ids: Tensor  # (n,)
    limits: Tensor  # (n,)
    scores: Tensor  # (n, k) log P: one hypothesis (BOS) at step 0, then K
    tokens: Tensor  # (n, k, width)
    floors: list[Tensor]  # per alpha, (n,)
    ceilings: list[Tensor]  # per alpha, (n,)
    stopped: Tensor  # (n,) True where the sentence stopped but stays in the batch (constant shapes)
    alphas: list[float]  # the length penalties served, in the order of floors and ceilings
    lookahead: int | None = None  # beam_search's: None, the exact stop (done)

    @classmethod
    def start(cls, limits: Tensor, alphas: list[float], width: int, lookahead: int | None = None) -> Searching:
        check_lookahead(lookahead)
        if lookahead is not None and len(alphas) > 1:  # an alpha past its stop would still take finished ones
            raise ValueError("lookahead serves one alpha: a search for several (make tune's) stops exactly")
        B, device = limits.size(0), limits.device
        return cls(
            torch.arange(B, device=device),
            limits,
            torch.zeros((B, 1), device=device),
            torch.full((B, 1, width), PAD_ID, dtype=torch.long, device=device),
            [torch.full((B,), -torch.inf, device=device) for _ in alphas],
            [length_penalty(limits + 1, a) for a in alphas],
            torch.zeros(B, dtype=torch.bool, device=device),
            alphas,
            lookahead,
        )

    def done(self, t: int) -> Tensor:
        """(n,) True where no live hypothesis can beat the n_best-th finished one, whichever the alpha, after step t
        (a live one has t + 1 tokens; ending next, t + 2 with its EOS). With a lookahead N (not the paper's), only
        by ending within N + 1 more tokens (its penalty at most that of t + 2 + N tokens): close to HF's
        early_stopping=False, which looks no further than the current length; measured in docs/inference.md."""
        best, ceilings = self.scores[:, 0], self.ceilings
        if self.lookahead is not None:
            longest = (self.limits + 1).clamp(max=t + 2 + self.lookahead)
            ceilings = [length_penalty(longest, a) for a in self.alphas]
        done = self.floors[0] >= best / ceilings[0]
        for floor, ceiling in zip(self.floors[1:], ceilings[1:]):
            done &= floor >= best / ceiling
        return done

    def finish(self, finished: list[Finished], ended: Tensor, scores: Tensor, parent: Tensor, token: Tensor, t: int,
               n_best: int) -> None:  # fmt: skip
        """Step t's candidates (n, K) that `ended`, of log P `scores`, extending `parent` by `token` (EOS), merged into
        each alpha's finished ones; each alpha's floor, its n_best-th finished score, follows."""
        history = self.continued(parent, token, t)  # (n, K, width)
        for i, (fin, alpha) in enumerate(zip(finished, self.alphas)):
            normalised = scores.div(length_penalty(t + 1, alpha)).masked_fill_(~ended, -torch.inf)
            self.floors[i] = fin.add(self.ids, normalised, history)[:, n_best - 1]

    def continued(self, parent: Tensor, token: Tensor, t: int) -> Tensor:
        """The tokens (n, k', width) of the live hypotheses `parent` (n, k') continued by `token` (n, k') at t."""
        tokens = gather_hypotheses(self.tokens, parent)
        tokens[:, :, t] = token
        return tokens

    def keep(self, index: Tensor) -> None:
        """Only the sentences `index` (n',) go on searching, in that order."""
        self.ids, self.limits, self.scores, self.tokens, self.stopped = (
            x[index] for x in (self.ids, self.limits, self.scores, self.tokens, self.stopped)
        )
        self.floors, self.ceilings = [f[index] for f in self.floors], [c[index] for c in self.ceilings]


Alphas = float | Sequence[float]  # one length penalty, or several served by one search (beam_search)


def one_alpha(alpha: Alphas) -> bool:
    return isinstance(alpha, int | float)


def alpha_list(alpha: Alphas) -> list[float]:
    return [alpha] if one_alpha(alpha) else list(alpha)


@torch.inference_mode()
def beam_search(
    model: Transformer,
    src: Tensor,
    beam_size: int = PAPER.beam_size,
    alpha: Alphas = PAPER.alpha,
    max_len_a: float = PAPER.max_len_a,
    max_len_b: int = PAPER.max_len_b,
    n_best: int = 1,
    lookahead: int | None = None,
) -> tuple[list[list[int]], list[list[tuple[list[int], float]]]] | list:
    """§6.1 beam search, vectorised over sentences and beams; the first step once per sentence, from BOS, before
    the beam expands to K. A hypothesis Y scores log P(Y) / length_penalty(|Y|). A sentence stops when its n_best-th
    best finished hypothesis beats the best any live one could reach (its log-probability only falls, its penalty
    is at most that of the maximum length), so the n best it returns are those of a search that never stops early;
    or at the maximum length, where EOS is forced. Finished sentences leave the batch (with model.constant_shapes
    they stay, masked: every step has the same shapes, for a compiled step). Returns the best tokens per
    sentence and its n-best list of (tokens, score), best first; tokens exclude BOS/EOS. n_best <= beam_size.

    lookahead=N: a stop sooner than the paper's (Searching.done; None: the exact stop above).

    Several alphas (make tune's grid): which hypotheses live and which end never depend on alpha, only which
    finished ones rank best and when a sentence may stop; one search keeps each alpha's finished ones and stops a
    sentence once it may for all: a list of results, one per alpha, each that alpha's search alone."""
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best={n_best}: must be between 1 and the beam size {beam_size}")
    B, K, device, alphas = src.size(0), beam_size, src.device, alpha_list(alpha)
    state, limits, width = start_decoding(model, src, max_len_a, max_len_b)  # B rows; B * K after step 0
    alive = Searching.start(limits, alphas, width, lookahead)
    prev = torch.full((B,), BOS_ID, dtype=torch.long, device=device)
    finished = [Finished.empty(B, K, width, device) for _ in alphas]  # per alpha, per original sentence
    soonest = int(limits.min())  # the first step at which a sentence still searching must end

    for t in range(width):
        n, k = alive.scores.shape
        at_limit = (t >= alive.limits).repeat_interleave(k) if t >= soonest else None  # EOS forced there
        logprobs = next_token_logprobs(model, prev, state, at_limit)  # (n*k, V)
        top_scores, beam, token = best_candidates(logprobs, alive.scores, 2 * K)  # 2K: at most K end in EOS
        ends = token.eq(EOS_ID)

        # Finished: EOS candidates among the top K (as a beam of K would take them; so beam 1 is greedy), merged
        # with those kept so far, the best K kept; most steps end none. (Constant shapes: a sentence that stopped
        # is still in the batch, its finished ones kept as they were.)
        ended = ends[:, :K] & ~alive.stopped[:, None] if model.constant_shapes else ends[:, :K]
        if ended.any():
            alive.finish(finished, ended, top_scores[:, :K], beam[:, :K], token[:, :K], t, n_best)

        # Alive: the best K candidates that did not end.
        alive.scores, pick = top_scores.masked_fill(ends, -torch.inf).topk(K, dim=1)
        parent, prev = beam.gather(1, pick), token.gather(1, pick)  # (n, K): the hypothesis each extends, how
        alive.tokens = alive.continued(parent, prev, t)
        rows = (parent + torch.arange(0, n * k, k, device=device)[:, None]).view(-1)  # (n*K,) of n*k
        prev = prev.view(-1)
        done = alive.done(t) | alive.stopped if model.constant_shapes else alive.done(t)
        stopped = int(done.sum())  # a wait for the device, as ended.any() above: two a step
        if stopped == n:
            break
        if model.constant_shapes:  # every sentence stays; those that stopped are masked
            alive.stopped = done
            state.select(rows)
        elif stopped:  # drop finished sentences (and their encoder states) from the batch
            keep = (~done).nonzero().squeeze(1)
            alive.keep(keep)
            soonest = int(alive.limits.min())
            state.select(rows.view(n, K)[keep].view(-1), sentences=keep)
            prev = prev.view(n, K)[keep].view(-1)
        else:  # rows only permute (or, after step 0, expand) the beams of each sentence: encoder states stay
            state.select(rows)

    results = [([h[0][0] for h in nbest], nbest) for nbest in (fin.nbest(n_best) for fin in finished)]
    return results[0] if one_alpha(alpha) else results


def translate_ids(
    model: Transformer,
    sources: list,
    beam_size: int = 1,
    alpha: Alphas = PAPER.alpha,
    max_len_a: float = PAPER.max_len_a,
    max_len_b: int = PAPER.max_len_b,
    tokens_per_batch: int = 16384,
    progress: bool = False,
    n_best: int = 0,
    lookahead: int | None = None,
) -> list:
    """Translate token-id sequences in length-sorted batches; results come back in input order.

    A batch holds at most `tokens_per_batch` source tokens counted over all beams (sentences x
    beam x longest). `progress` shows a bar of translated sentences on stderr. Each result is the
    best tokens; with n_best=K > 0, the K best (tokens, score) pairs instead, best first (K <= beam_size).
    Several alphas: one search for all (beam_search), a list of results per alpha. lookahead: beam_search's.
    """
    if n_best > beam_size:
        raise InputError(f"n_best={n_best} exceeds the beam size {beam_size}: set decoding.beam_size={n_best} or more")
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    alphas = alpha_list(alpha)
    results: list = [[[] for _ in sources] for _ in alphas]
    device = next(model.parameters()).device
    was_training = model.training
    if was_training:
        model.eval()
    bar = tqdm(
        total=len(sources),
        desc="translating",
        unit="sentence",
        disable=not progress,
        leave=False,
        mininterval=1 if sys.stderr.isatty() else 30,
    )  # in a log file: a line every 30 s
    start = 0
    while start < len(order):
        end = start + 1  # grow the batch while (sentences x beam x longest) fits tokens_per_batch
        while end < len(order) and (end - start + 1) * beam_size * (len(sources[order[end]]) + 1) <= tokens_per_batch:
            end += 1
        src = source_batch([sources[i] for i in order[start:end]], device)
        if beam_size == 1 and not n_best:  # greedy: alpha changes nothing
            per_alpha = [greedy(model, src, max_len_a, max_len_b)] * len(alphas)
        else:
            found = beam_search(model, src, beam_size, alphas, max_len_a, max_len_b, max(n_best, 1), lookahead)
            per_alpha = [nbest if n_best else best for best, nbest in found]
        for alpha_results, hyps in zip(results, per_alpha):
            for i, hyp in zip(order[start:end], hyps):
                alpha_results[i] = hyp
        bar.update(end - start)
        start = end
    bar.close()
    if was_training:
        model.train()
    return results[0] if one_alpha(alpha) else results


def translate_lines(
    model: Transformer, tokenizer: Tokenizer, lines: list[str], warn=None, first_line: int = 1, **decoding
) -> list:  # decoding: translate_ids' options (conf/decoding, progress, n_best)
    """Text in, text out, same order. Empty lines stay empty; inputs longer than the model's
    positions are truncated, calling `warn(message)` for each (lines numbered from first_line).
    With n_best=K, each line gives its K best (text, score) pairs instead of a text. Several alphas: a list of
    those outputs, one per alpha, from one search (beam_search)."""
    limit = model.cfg.max_positions - 1  # room for EOS
    sources = tokenizer.encode([line.strip() for line in lines])
    for i, ids in enumerate(sources):
        if len(ids) > limit:
            if warn:
                warn(f"line {first_line + i}: {len(ids)} tokens, truncated to the model's maximum of {limit}")
            sources[i] = ids[:limit]
    todo = [i for i, ids in enumerate(sources) if ids]
    results = translate_ids(model, [sources[i] for i in todo], **decoding)

    def texts(results: list) -> list:
        if decoding.get("n_best"):  # each line: its K best (text, score), best first; an empty line: ("", 0.0)
            outputs = [[("", 0.0)] for _ in lines]
            for i, hyps in zip(todo, results):
                outputs[i] = list(zip(tokenizer.decode([ids for ids, _ in hyps]), [score for _, score in hyps]))
            return outputs
        outputs = [""] * len(lines)
        for i, text in zip(todo, tokenizer.decode(results)):
            outputs[i] = text
        return outputs

    return texts(results) if one_alpha(decoding.get("alpha", PAPER.alpha)) else [texts(r) for r in results]


def nbest_lines(number: int, hyps: list[tuple[str, float]]) -> str:
    """One sentence's n-best list in Moses' format: "<sentence number, from 0> ||| <translation> ||| <score>" lines."""
    return "".join(f"{number} ||| {text} ||| {score:.4f}\n" for text, score in hyps)
