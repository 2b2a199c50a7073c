"""Ours against peers, side by side in one run: training and decoding speed, and how close the exports translate.

  make bench CKPT=outputs/m30k/checkpoints/average-last5.ckpt \\
      SRC=../shared/data/multi30k/test_2016_flickr.en REF=../shared/data/multi30k/test_2016_flickr.de

Training, per model shape (--shapes, presets of conf/model): target tokens/s of one update
(forward, label-smoothed loss, backward, fused Adam) for ours, transformers' MarianMTModel and
torch.nn.Transformer of the same shape, on the same batches: real sentence lengths (SRC/REF
through the checkpoint's tokenizer, else random lengths), random ids, at most --max-tokens
padded tokens per side. Precision as `trainer=cpu` picks it: bf16 autocast where the CPU
computes bf16 natively, else fp32. Also printed: model FLOP/s (transformer_mt.model.training_flops:
real tokens only, attention included, decoder self-attention causal) as a share of the
matrix-multiply peak measured in the same run, the share of CPU time spent in the kernel (system
time), and minor page faults per update.

Decoding (needs CKPT and SRC): ours (eager; and compiled: compile=true), engine=ct2 (make translate's
CTranslate2 engine: CTranslate2 float32 in a child process), transformers' generate and CTranslate2
(float32, int8) on the same weights (make export's conversion), beam 4 and greedy, on every sentence of SRC:
sentences/s, the share of sentences identical to ours, BLEU when REF is given, and the
latency of one sentence at beam 4. Our alpha 0.6 (GNMT penalty) is compared with their 0.45
(|Y|^alpha), which picks the same translations most often (docs/inference.md, the export table).

Exports (--parts exports, needs CKPT, SRC and REF): how close the exported models translate to
ours: the share of identical sentences and sacreBLEU of transformers (fp32) and CTranslate2 (fp32,
int8) at beam 1 and at beam 4 for each of their length penalties in --alphas, each compared with
ours at the same beam (alpha 0 against our alpha 0, others against our 0.6).

Plan (--parts plan): CPU seconds of one epoch's batch plan (TokenBucketSampler.all_batches: shuffle, sort by
length, fill batches, deal them to ranks) for --pairs sentence pairs drawn from the training part's lengths, at
WMT14's 25,000 tokens on 1 GPU and 3,125 per GPU on 8: every rank's main process pays it at each epoch's start.

Every speed figure is the median of --repeats rounds; within a round the systems take turns (for
decoding each in a fresh process: CTranslate2's OpenMP runtime and ours slow each other down).
Peers need the `export` extra: pip install -e ".[export]" (make install does).
"""

# ruff: noqa: E402 (the stop handler is set before the imports, which take seconds)
from __future__ import annotations

from transformer_mt.stops import stop_quietly

if __name__ == "__main__":  # not in the decoding workers (spawned: __mp_main__), whose stop is the parent's line
    stop_quietly()  # as every command's: a stop while the libraries below load is one line, not a traceback

import multiprocessing
import random
import resource
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import sacrebleu
import torch

import host_overhead
from transformer_mt.checkpoint import load_for_inference
from transformer_mt.configs import model_preset
from transformer_mt.data.batching import TokenBucketSampler, collate
from transformer_mt.data.corpus import read_text_pair
from transformer_mt.decoding import HF_LENGTH_PENALTY, PAPER
from transformer_mt.errors import CommandParser, exit_on_user_error
from transformer_mt.evaluation.engines import CT2Process, ct2_export
from transformer_mt.files import read_lines
from transformer_mt.model import Transformer, TransformerConfig, training_flops
from transformer_mt.objective import label_smoothed_nll, sequence_losses
from transformer_mt.runtime import compile_decoding, cpu_has_native_bf16, keep_freed_memory, usable_cores
from transformer_mt.search import translate_lines
from transformer_mt.tokenizer import PAD_ID
from transformer_mt.tools.export import export, marian_model, optional


def median_of(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class Usage:
    """CPU time (user, system) and minor page faults of this process over a block of work."""

    def __enter__(self):
        self.start = resource.getrusage(resource.RUSAGE_SELF)
        self.wall = time.perf_counter()
        return self

    def __exit__(self, *exc):
        end = resource.getrusage(resource.RUSAGE_SELF)
        self.seconds = time.perf_counter() - self.wall
        self.user = end.ru_utime - self.start.ru_utime
        self.system = end.ru_stime - self.start.ru_stime
        self.faults = end.ru_minflt - self.start.ru_minflt


# ---------------------------------------------------------------- batch plan


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of the fastest of `repeats` n x n matrix products (after one that allocates and wakes the threads)."""
    values = torch.Generator().manual_seed(0)  # not the global generator
    a, b = (torch.randn(n, n, generator=values).to(dtype) for _ in range(2))
    a @ b
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        fastest = min(fastest, time.perf_counter() - start)
    return 2 * n**3 / fastest


def bench_plan(args, pairs: list[tuple[int, int]]) -> None:
    """CPU seconds of one epoch's batch plan for --pairs pairs (lengths drawn from `pairs`), median of --repeats."""
    lengths = np.array(pairs)[np.random.default_rng(0).integers(0, len(pairs), args.pairs)]
    print(f"\nbatch plan (TokenBucketSampler.all_batches), {args.pairs:,} pairs, CPU seconds, median of {args.repeats}")
    for max_tokens, world in ((25_000, 1), (3_125, 8)):
        sampler = TokenBucketSampler(lengths[:, 0], lengths[:, 1], max_tokens, seed=0, world_size=world)
        seconds = []
        for epoch in range(args.repeats):
            start = time.process_time()
            batches = sampler.all_batches(epoch)
            seconds.append(time.process_time() - start)
        print(f"  {max_tokens:>6,} tokens x {world} rank(s): {median_of(seconds):.3f} s, {len(batches):,} batches")


# ---------------------------------------------------------------- training


def length_pairs(args, tokenizer) -> list[tuple[int, int]]:
    """(source, target) token counts of real sentence pairs, or random ones (5-30) without data."""
    if args.src and args.ref and tokenizer is not None:
        sources, targets = read_text_pair(args.src, args.ref)
        return [(len(s), len(t)) for s, t in zip(tokenizer.encode(sources), tokenizer.encode(targets)) if s and t]
    rng = random.Random(0)
    return [(rng.randint(5, 30), rng.randint(5, 30)) for _ in range(5000)]


def training_batches(pairs, vocab: int, max_tokens: int, count: int, seed: int = 0) -> list[dict]:
    """`count` batches as the data module builds them (similar lengths, <= max_tokens padded tokens per
    side, + EOS/BOS, data.batching.collate's layout), from a random sample of the pairs; ids are random."""
    rng = random.Random(seed)
    ids = np.random.default_rng(seed)
    sample = rng.sample(pairs, min(len(pairs), 40 * count * max_tokens // 400))
    pool = sorted(sample, key=lambda p: (max(p), sum(p)))  # as TokenBucketSampler: longer side, then total
    batches = []
    for _ in range(count):
        start = end = rng.randrange(len(pool))
        longest = 0  # grow the batch while rows x (longest + EOS) fits, on both sides
        while end < len(pool) and (end - start + 1) * (1 + max(longest, *pool[end])) <= max_tokens:
            longest = max(longest, *pool[end])
            end += 1
        rows = pool[start : max(end, start + 1)]
        items = [(ids.integers(4, vocab, s), ids.integers(4, vocab, t), i) for i, (s, t) in enumerate(rows)]
        batches.append(collate(items))
    return batches


def batch_flops(cfg: TransformerConfig, batch: dict) -> float:
    return training_flops(cfg, batch["src_lengths"], batch["tgt_lengths"])


def marian_loss(hf, batch: dict):
    """transformers' own forward (full logits, as its users train), our label-smoothed loss on the targets."""
    src, keep = batch["src"], batch["tgt_out"].ne(PAD_ID)
    logits = hf(input_ids=src, attention_mask=src.ne(PAD_ID), decoder_input_ids=batch["tgt_in"]).logits
    return label_smoothed_nll(logits[keep], batch["tgt_out"][keep], 0.1)


def ours_loss(model, batch: dict):
    src, tgt_in, tgt_out, positions = (batch[k] for k in ("src", "tgt_in", "tgt_out", "target_positions"))
    return sequence_losses(model, src, tgt_in, tgt_out, 0.1, positions)  # as training does


class TorchPeer(torch.nn.Module):
    """torch.nn.Transformer (post-norm, ReLU) with our embedding, positions and tied output projection,
    without the final LayerNorm it adds after each stack (not in the paper; tests/test_model.py's
    reference drops it too): the same work as ours."""

    def __init__(self, ours: Transformer):
        super().__init__()
        cfg = self.cfg = ours.cfg
        self.embed = ours.embed
        self.stack = torch.nn.Transformer(
            cfg.d_model,
            cfg.n_heads,
            cfg.n_encoder_layers,
            cfg.n_decoder_layers,
            cfg.d_ff,
            cfg.dropout,
            batch_first=True,
            norm_first=False,
        )
        self.stack.encoder.norm = self.stack.decoder.norm = None

    def features(self, src, tgt_in):
        causal = torch.ones(tgt_in.size(1), tgt_in.size(1), dtype=torch.bool, device=src.device).triu(1)
        pad = src.eq(PAD_ID)
        return self.stack(
            self.embed(src), self.embed(tgt_in), tgt_mask=causal, src_key_padding_mask=pad, memory_key_padding_mask=pad
        )

    @property
    def output_weight(self):
        return self.embed.tokens.weight  # tied, as ours


def train_round(model, loss_fn, batches, dtype, warmup: list) -> tuple[float, Usage]:
    """Seconds of the updates on `batches` (after warm-up updates on `warmup`) and their CPU usage.
    A compiled loss_fn warms up on every batch: dynamic shapes still guard on some sizes (a length of 1,
    two lengths equal), and a batch that compiled again inside the timed loop would be timed with it."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    model.train()

    def update(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss, _, n = loss_fn(model, batch)
        (loss / n).backward()
        optimizer.step()
        optimizer.zero_grad()

    for batch in warmup:
        update(batch)
    with Usage() as usage:
        for batch in batches:
            update(batch)
    return usage.seconds, usage


def bench_training(args, shape: str, pairs, dtype) -> None:
    torch.manual_seed(0)
    ours = Transformer(TransformerConfig(vocab_size=args.vocab, **model_preset(shape)))
    systems = {"transformer_mt": (ours, ours_loss)}
    transformers = optional("transformers")
    transformers.logging.set_verbosity_error()
    systems["transformers Marian"] = (marian_model(ours), marian_loss)
    systems["torch.nn.Transformer"] = (TorchPeer(Transformer(ours.cfg)), ours_loss)
    if args.compile:  # trainer.compile's way (TranslationModule.compile_training), and transformers' forward compiled
        systems["transformer_mt compiled"] = (ours, torch.compile(ours_loss, dynamic=True))
        systems["transformers compiled"] = (systems["transformers Marian"][0], torch.compile(marian_loss, dynamic=True))
    batches = training_batches(pairs, args.vocab, args.max_tokens, args.steps)
    flops = sum(batch_flops(ours.cfg, b) for b in batches)
    tokens = sum(int(b["tgt_out"].ne(PAD_ID).sum()) for b in batches)
    padded = sum(b["tgt_out"].numel() for b in batches)
    print(
        f"\ntraining, {shape} shape (d {ours.cfg.d_model}, {ours.cfg.n_encoder_layers}+{ours.cfg.n_decoder_layers} "
        f"layers, vocabulary {args.vocab}, {sum(p.numel() for p in ours.parameters()) / 1e6:.1f}M parameters), "
        f"{'bf16 autocast' if dtype == torch.bfloat16 else 'fp32'}: {args.steps} updates of <= {args.max_tokens} "
        f"padded tokens per side ({tokens / args.steps:.0f} real target tokens each, {100 * tokens / padded:.0f}% "
        f"of the padded), median of {args.repeats} rounds"
    )
    seconds = {name: [] for name in systems}
    usages = {name: [] for name in systems}
    peaks = []
    for _ in range(args.repeats):
        peaks.append(matmul_peak(dtype))
        for name, (model, loss_fn) in systems.items():
            warmup = batches if name.endswith("compiled") else batches[:1]
            took, usage = train_round(model, loss_fn, batches, dtype, warmup)
            seconds[name].append(took)
            usages[name].append(usage)
    peak = median_of(peaks)
    ours_speed = tokens / median_of(seconds["transformer_mt"])
    print(f"matrix-multiply peak ({'bf16' if dtype == torch.bfloat16 else 'fp32'} 2048^3): {peak / 1e9:.0f} GFLOP/s")
    print(
        f"{'system':<24} {'target tok/s':>12} {'ours / it':>9} {'GFLOP/s':>8} {'of peak':>7} {'system time':>11} "
        f"{'faults/update':>13}"
    )
    for name in systems:
        took = median_of(seconds[name])
        cpu = sum(u.user + u.system for u in usages[name])
        system_share = sum(u.system for u in usages[name]) / cpu
        faults = median_of([u.faults for u in usages[name]]) / args.steps
        print(
            f"{name:<24} {tokens / took:>12,.0f} {ours_speed / (tokens / took):>8.2f}x {flops / took / 1e9:>8.1f} "
            f"{100 * flops / took / peak:>6.0f}% {100 * system_share:>10.1f}% {faults:>13,.0f}"
        )


# ---------------------------------------------------------------- decoding


def hf_translate(hf, hf_tokenizer, sources: list[str], beam: int, alpha: float, batch: int = 64) -> list[str]:
    """MarianMTModel.generate in length-sorted batches, at most source + 50 tokens (§6.1); beam > 1 stops
    only when no live hypothesis can win, as ours."""
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    out = [""] * len(sources)
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        inputs = hf_tokenizer([sources[i] for i in rows], return_tensors="pt", padding=True)
        # (num_beams=1 must be said: the exported generation_config.json defaults to beam 4)
        search = dict(num_beams=beam, length_penalty=alpha, early_stopping="never") if beam > 1 else {"num_beams": 1}
        with torch.no_grad():
            generated = hf.generate(**inputs, **search, do_sample=False, max_length=inputs.input_ids.size(1) + 51)
        for i, text in zip(rows, hf_tokenizer.batch_decode(generated, skip_special_tokens=True)):
            out[i] = text
    return out


def ct2_translate(translator, sp, sources: list[str], beam: int, alpha: float, batch: int = 64) -> list[str]:
    """CTranslate2's translate_batch on SentencePiece pieces (it sorts by length inside), at most source + 50."""
    pieces = [sp.encode(s.strip(), out_type=str) for s in sources]
    results = translator.translate_batch(
        pieces,
        beam_size=beam,
        length_penalty=alpha,
        max_batch_size=batch,
        batch_type="examples",
        max_decoding_length=max(map(len, pieces)) + 51,
    )
    return [sp.decode_pieces(r.hypotheses[0]) for r in results]


SYSTEMS = [
    "transformer_mt",
    "transformer_mt compiled",  # compile=true: runtime.compile_decoding
    "engine=ct2",  # make translate/evaluate engine=ct2: engines.CT2Process, CTranslate2 float32 in a child process
    "transformers generate",
    "CTranslate2 float32",
    "CTranslate2 int8",
]


def decode_worker(system: str, ckpt: str, exported: dict, sources: list[str], singles: list[str], threads: int) -> dict:
    """One round of one system on `threads` intra-op threads, in a fresh process:
    {"outputs": {beam: texts}, "seconds": {beam: s}, "latency": [ms]}.

    A process of its own, because two OpenMP runtimes in one process slow each other down for good:
    CTranslate2 brings its own libgomp, and after both had run, our one-sentence latency went from
    99 to 157-170 ms and CTranslate2's from 32 to 167 ms, pauses of seconds notwithstanding."""
    keep_freed_memory()
    torch.set_num_threads(threads)
    if system.startswith("transformer_mt"):
        model, tokenizer, _ = load_for_inference(ckpt)
        if system.endswith("compiled"):
            compile_decoding(model)

        def run(lines, beam):
            return translate_lines(model, tokenizer, lines, beam_size=beam, alpha=PAPER.alpha)

    elif system == "engine=ct2":
        engine = CT2Process(Path(exported["engine"]), device="cpu", threads=threads)

        def run(lines, beam):
            return engine.translate_lines(lines, beam_size=beam, alpha=PAPER.alpha)

    elif system == "transformers generate":
        transformers = optional("transformers")
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        hf = transformers.MarianMTModel.from_pretrained(exported["hf"]).eval()
        hf_tokenizer = transformers.MarianTokenizer.from_pretrained(exported["hf"])

        def run(lines, beam):
            return hf_translate(hf, hf_tokenizer, lines, beam, HF_LENGTH_PENALTY)

    else:
        kind = system.split()[-1]
        translator = optional("ctranslate2").Translator(
            exported["ct2"], device="cpu", compute_type=kind, intra_threads=threads
        )
        # not load_for_inference: running torch before CTranslate2 in a process made CTranslate2 7x slower
        # (one sentence: 15 -> 103 ms), their two OpenMP thread pools competing for the cores
        sp = optional("sentencepiece").SentencePieceProcessor(model_file=f"{exported['ct2']}/sentencepiece.model")

        def run(lines, beam):
            return ct2_translate(translator, sp, lines, beam, HF_LENGTH_PENALTY)

    for beam in (4, 1):  # warm-up: the compiled step compiles for a batch and for one sentence here
        run(sources[:8], beam)
        run(singles[:1], beam)
    result = {"outputs": {}, "seconds": {}, "latency": []}
    for beam in (4, 1):
        start = time.perf_counter()
        result["outputs"][beam] = run(sources, beam)
        result["seconds"][beam] = time.perf_counter() - start
    for line in singles:
        start = time.perf_counter()
        run([line], 4)
        result["latency"].append(1000 * (time.perf_counter() - start))
    return result


def bench_decoding(args) -> None:
    optional("transformers").logging.set_verbosity_error()
    if args.ref:
        sources, references = read_text_pair(args.src, args.ref)
    else:
        sources, references = read_lines(args.src), None
    sources, references = sources[: args.limit], references and references[: args.limit]
    by_length = sorted(sources, key=len)  # one-sentence latency: sentences of median length, each alone
    singles = by_length[len(by_length) // 2 - args.latency // 2 :][: args.latency]
    # Every system at 1 thread and at every core, each figure at both and its best: a peer is never shown
    # only in a configuration that suits it badly (CTranslate2 at 2 threads was erratic on a 2-core VM).
    thread_counts = sorted({1, usable_cores()})
    systems = [name for name in SYSTEMS if args.compile or not name.endswith("compiled")]
    speed = {(name, beam, n): [] for name in systems for beam in (4, 1) for n in thread_counts}
    latency = {(name, n): [] for name in systems for n in thread_counts}
    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        optional("ctranslate2")
        exported = {fmt: str(export(args.ckpt, fmt, f"{tmp}/{fmt}")) for fmt in ("hf", "ct2")}
        (Path(tmp) / "engine.ckpt").symlink_to(Path(args.ckpt).resolve())  # engine=ct2's export, beside it
        exported["engine"] = str(ct2_export(Path(tmp) / "engine.ckpt", log=lambda message: None))
        print(
            f"\ndecoding {len(sources)} sentences of {args.src} (median of {args.repeats} rounds, each system "
            f"in a fresh process), {args.ckpt}; latency: {len(singles)} median-length sentences one at a time, beam 4"
        )
        spawn = multiprocessing.get_context("spawn")
        for round_ in range(args.repeats):
            for n in thread_counts:
                for name in systems:
                    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
                        job = pool.submit(decode_worker, name, args.ckpt, exported, sources, singles, n)
                        result = job.result()
                    for beam in (4, 1):
                        outputs[name, beam] = result["outputs"][beam]
                        speed[name, beam, n].append(len(sources) / result["seconds"][beam])
                    latency[name, n] += result["latency"]
                    rates = ", ".join(f"beam {beam} {speed[name, beam, n][-1]:,.1f}" for beam in (4, 1))
                    where = f"{n} thread(s), round {round_ + 1} of {args.repeats}"  # no silent minutes before the table
                    print(f"  measured {name} at {where}: sentences/s {rates}", flush=True)
    columns = "".join(f" {f'sent/s {n}t':>10}" for n in thread_counts) + "".join(
        f" {f'latency {n}t':>11}" for n in thread_counts
    )
    print(f"{'system':<24} {'beam':>4}{columns} {'ours / it':>9} {'same as ours':>12} {'BLEU':>6}")
    for beam in (4, 1):
        best_ours = max(median_of(speed["transformer_mt", beam, n]) for n in thread_counts)
        for name in systems:
            hyps = outputs[name, beam]
            same = sum(h == o for h, o in zip(hyps, outputs["transformer_mt", beam])) / len(hyps)
            bleu = f"{sacrebleu.corpus_bleu(hyps, [references]).score:6.2f}" if references else f"{'':>6}"
            rates = [median_of(speed[name, beam, n]) for n in thread_counts]
            lats = [f"{median_of(latency[name, n]):>8.0f} ms" if beam == 4 else f"{'':>11}" for n in thread_counts]
            row = "".join(f" {r:>10.1f}" for r in rates) + "".join(f" {lat}" for lat in lats)
            print(f"{name:<24} {beam:>4}{row} {best_ours / max(rates):>8.2f}x {100 * same:>11.1f}% {bleu}")
    print("ours / it: each system's best thread count against ours at its best; latency: one sentence, beam 4")


# ---------------------------------------------------------------- how close the exports translate to ours


def bench_exports(args) -> None:
    """One table: for each exported system, beam and length penalty, the share of sentences identical to
    ours and sacreBLEU (GNMT's ((5 + |Y|) / 6)^alpha is ours, |Y|^alpha theirs)."""
    transformers, ctranslate2 = optional("transformers"), optional("ctranslate2")
    transformers.logging.set_verbosity_error()
    sources, references = read_text_pair(args.src, args.ref)
    sources, references = sources[: args.limit], references[: args.limit]
    model, tokenizer, _ = load_for_inference(args.ckpt)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, ct2_dir = export(args.ckpt, "hf", f"{tmp}/hf"), export(args.ckpt, "ct2", f"{tmp}/ct2")
        hf = transformers.MarianMTModel.from_pretrained(hf_dir).eval()
        hf_tokenizer = transformers.MarianTokenizer.from_pretrained(hf_dir)
        ct2 = {
            kind: ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type=kind) for kind in ("float32", "int8")
        }
        systems = {
            "transformers fp32": lambda beam, alpha: hf_translate(hf, hf_tokenizer, sources, beam, alpha),
            "CTranslate2 fp32": lambda beam, alpha: ct2_translate(ct2["float32"], tokenizer.sp, sources, beam, alpha),
            "CTranslate2 int8": lambda beam, alpha: ct2_translate(ct2["int8"], tokenizer.sp, sources, beam, alpha),
        }
        print(f"\nexports: {len(sources)} sentences of {args.src}; {args.ckpt}")
        print(f"{'system':<18} {'beam':>4} {'alpha':>5} {'vs ours':>12} {'identical':>9} {'BLEU':>6}")
        ours = {}
        for beam, alpha in [(1, 0.0), (4, PAPER.alpha), (4, 0.0)]:
            ours[beam, alpha] = translate_lines(model, tokenizer, sources, beam_size=beam, alpha=alpha)
            bleu = sacrebleu.corpus_bleu(ours[beam, alpha], [references]).score
            print(f"{'ours':<18} {beam:>4} {alpha:>5.2f} {'':>12} {'':>9} {bleu:>6.2f}")
        for system, run in systems.items():
            for beam, alpha in [(1, 0.0)] + [(4, a) for a in args.alphas]:
                hyps = run(beam, alpha)
                key = (1, 0.0) if beam == 1 else (4, 0.0 if alpha == 0 else PAPER.alpha)
                same = 100 * sum(h == o for h, o in zip(hyps, ours[key])) / len(hyps)
                bleu = sacrebleu.corpus_bleu(hyps, [references]).score
                versus = f"beam {key[0]} a={key[1]}"
                print(f"{system:<18} {beam:>4} {alpha:>5.2f} {versus:>12} {same:>8.1f}% {bleu:>6.2f}")


PARTS = ("training", "decoding", "exports", "host", "plan")


def main() -> None:
    parser = CommandParser(__doc__)
    parser.add_argument("--ckpt", help="a trained checkpoint: decoding peers, and the tokenizer for real lengths")
    parser.add_argument("--src", help="source sentences: decoding input, and lengths for the training batches")
    parser.add_argument("--ref", help="references of --src: BLEU, and target lengths for the training batches")
    parser.add_argument("--shapes", default="small,base", help="model presets (conf/model) to train, comma-separated")
    parser.add_argument("--vocab", type=int, default=8000, help="vocabulary of the training shapes")
    parser.add_argument("--max-tokens", type=int, default=2048, help="padded tokens per side of a training batch")
    parser.add_argument("--steps", type=int, default=4, help="timed training updates per round")
    parser.add_argument(
        "--no-compile", dest="compile", action="store_false", help="leave out the torch.compile rows (all parts)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds; every figure is the median")
    parser.add_argument("--limit", type=int, help="decode the first N sentences of --src only")
    parser.add_argument("--latency", type=int, default=10, help="sentences timed one at a time")
    parser.add_argument(
        "--parts", default="training,decoding,host", help=f"what to measure, comma-separated, of {', '.join(PARTS)}"
    )
    parser.add_argument("--pairs", type=int, default=4_500_000, help="plan: sentence pairs (WMT14: 4.5M)")
    parser.add_argument(
        "--alphas", default="0,0.6,0.45", help="exports: their length penalties (|Y|^alpha) to try at beam 4"
    )
    args = parser.parse_args()
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        parser.error(f"--parts {args.parts}: choose from {', '.join(PARTS)}")
    args.alphas = [float(a) for a in args.alphas.split(",")]
    kept = keep_freed_memory()  # as make train does, for every system in this process
    print(
        f"{host_overhead.describe_machine()}; glibc malloc: "
        + ("no mmap, freed memory kept (runtime.py)" if kept else "defaults")
    )
    tokenizer = load_for_inference(args.ckpt)[1] if args.ckpt else None
    if "training" in parts:
        dtype = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        pairs = length_pairs(args, tokenizer)
        for shape in args.shapes.split(","):
            bench_training(args, shape, pairs, dtype)
    if "decoding" in parts:
        if not (args.ckpt and args.src):
            print("\ndecoding: skipped (give --ckpt and --src: make bench CKPT=... SRC=... [REF=...])")
        else:
            bench_decoding(args)
    if "exports" in parts:
        if not (args.ckpt and args.src and args.ref):
            print("\nexports: skipped (give --ckpt, --src and --ref: make bench CKPT=... SRC=... REF=...)")
        else:
            bench_exports(args)
    if "plan" in parts:
        bench_plan(args, length_pairs(args, tokenizer))
    if "host" in parts:
        host_overhead.run(["base", "big"], updates=12, compiled=args.compile)
    print(
        f"\npeak resident memory of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
    )


if __name__ == "__main__":
    exit_on_user_error(main)  # a refused checkpoint, a missing file, a wrong option: one line
