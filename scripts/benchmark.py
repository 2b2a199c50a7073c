"""Training and decoding speed of ours against peers, measured side by side in one run.

  make bench CKPT=outputs/m30k/checkpoints/average-last5.ckpt \\
      SRC=../shared/data/multi30k/test_2016_flickr.en REF=../shared/data/multi30k/test_2016_flickr.de

Training, per model shape (--shapes, presets of conf/model): target tokens/s of one update
(forward, label-smoothed loss, backward, fused Adam) for ours, transformers' MarianMTModel and
torch.nn.Transformer of the same shape, on the same batches: real sentence lengths (SRC/REF
through the checkpoint's tokenizer, else random lengths), random ids, at most --max-tokens
padded tokens per side. Precision as `trainer=cpu` picks it: bf16 autocast where the CPU
computes bf16 natively, else fp32. Also printed: model FLOP/s (6 x parameters-matmuls x real
tokens, attention included) as a share of the matrix-multiply peak measured in the same run,
the share of CPU time spent in the kernel (system time), and minor page faults per update.

Decoding (needs CKPT and SRC): ours, transformers' generate and CTranslate2 (float32, int8)
on the same weights (make export's conversion), beam 4 and greedy, on every sentence of SRC:
sentences/s, the share of sentences identical to ours, BLEU when REF is given, and the
latency of one sentence at beam 4. Our alpha 0.6 (GNMT penalty) is compared with their 0.45
(|Y|^alpha), which picks the same translations most often (README, "Shipping a model").

Every figure is the median of --repeats rounds; within a round the systems take turns (for
decoding each in a fresh process: CTranslate2's OpenMP runtime and ours slow each other down).
Peers need the `bench` extra: pip install -e ".[bench]".
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
import random
import resource
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import sacrebleu
import torch
from omegaconf import OmegaConf

from transformer_mt.checkpoint import load_for_inference
from transformer_mt.configs import CONF_DIR
from transformer_mt.data.corpus import read_text_pair
from transformer_mt.model import Transformer, TransformerConfig
from transformer_mt.objective import label_smoothed_nll, sequence_losses
from transformer_mt.peers import TorchPeer, ct2_translate, hf_translate
from transformer_mt.runtime import cpu_has_native_bf16, keep_freed_memory
from transformer_mt.search import pad_sources, translate_lines
from transformer_mt.tokenizer import BOS_ID, PAD_ID
from transformer_mt.tools.export import HF_LENGTH_PENALTY, export, marian_model, optional

OUR_ALPHA = 0.6  # §6.1


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    return (
        f"{model} ({platform.machine()}, {'/'.join(simd) or 'no AVX2'}), {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}"
    )


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


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a large square matrix product in `dtype`, the best of `repeats`."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


# ---------------------------------------------------------------- training


def length_pairs(args, tokenizer) -> list[tuple[int, int]]:
    """(source, target) token counts of real sentence pairs, or random ones (5-30) without data."""
    if args.src and args.ref and tokenizer is not None:
        sources, targets = read_text_pair(args.src, args.ref)
        return [(len(s), len(t)) for s, t in zip(tokenizer.encode(sources), tokenizer.encode(targets)) if s and t]
    rng = random.Random(0)
    return [(rng.randint(5, 30), rng.randint(5, 30)) for _ in range(5000)]


def training_batches(pairs, vocab: int, max_tokens: int, count: int, seed: int = 0):
    """`count` batches as the data module builds them (similar lengths, <= max_tokens padded tokens per
    side, + EOS), from a random sample of the pairs; ids are random."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
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
        src = pad_sources([torch.randint(4, vocab, (s,), generator=g).tolist() for s, _ in rows])
        tgt_out = pad_sources([torch.randint(4, vocab, (t,), generator=g).tolist() for _, t in rows])
        tgt_in = torch.cat([torch.full_like(tgt_out[:, :1], BOS_ID), tgt_out[:, :-1]], 1)
        batches.append((src, tgt_in.masked_fill(tgt_out.eq(PAD_ID), PAD_ID), tgt_out))
    return batches


def model_flops(cfg: TransformerConfig, batch) -> float:
    """Forward + backward (3 x forward) matrix-multiply FLOPs of one batch, counting real tokens only."""
    src, _, tgt_out = batch
    s_len, t_len = src.ne(PAD_ID).sum(1).double(), tgt_out.ne(PAD_ID).sum(1).double()
    s, t = s_len.sum().item(), t_len.sum().item()
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    encoder = cfg.n_encoder_layers * (s * (4 * d * d + 2 * d * f) + 2 * (s_len**2).sum().item() * d)
    decoder = cfg.n_decoder_layers * (
        t * (6 * d * d + 2 * d * f) + s * 2 * d * d + 2 * ((t_len**2).sum() + (t_len * s_len).sum()).item() * d
    )
    return 3 * 2 * (encoder + decoder + t * d * v)


def marian_loss(hf, src, tgt_in, tgt_out):
    """transformers' own forward (full logits, as its users train), our label-smoothed loss on the targets."""
    logits = hf(input_ids=src, attention_mask=src.ne(PAD_ID), decoder_input_ids=tgt_in).logits
    keep = tgt_out.ne(PAD_ID)
    return label_smoothed_nll(logits[keep], tgt_out[keep], 0.1)


def ours_loss(model, src, tgt_in, tgt_out):
    return sequence_losses(model, src, tgt_in, tgt_out, 0.1)  # as training does


def train_round(model, loss_fn, batches, dtype) -> tuple[float, Usage]:
    """Seconds of the updates on `batches` (after one warm-up update) and their CPU usage."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    model.train()

    def update(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss, _, n = loss_fn(model, *batch)
        (loss / n).backward()
        optimizer.step()
        optimizer.zero_grad()

    update(batches[0])
    with Usage() as usage:
        for batch in batches:
            update(batch)
    return usage.seconds, usage


def bench_training(args, shape: str, pairs, dtype) -> None:
    preset = OmegaConf.to_container(OmegaConf.load(f"{CONF_DIR}/model/{shape}.yaml"))
    torch.manual_seed(0)
    ours = Transformer(TransformerConfig(vocab_size=args.vocab, **preset))
    systems = {"transformer_mt": (ours, ours_loss)}
    transformers = optional("transformers")
    transformers.logging.set_verbosity_error()
    systems["transformers Marian"] = (marian_model(ours), marian_loss)
    systems["torch.nn.Transformer"] = (TorchPeer(Transformer(ours.cfg)), ours_loss)
    batches = training_batches(pairs, args.vocab, args.max_tokens, args.steps)
    flops = sum(model_flops(ours.cfg, b) for b in batches)
    tokens = sum(int(b[2].ne(PAD_ID).sum()) for b in batches)
    padded = sum(b[2].numel() for b in batches)
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
            took, usage = train_round(model, loss_fn, batches, dtype)
            seconds[name].append(took)
            usages[name].append(usage)
    peak = median_of(peaks)
    ours_speed = tokens / median_of(seconds["transformer_mt"])
    print(f"matrix-multiply peak ({'bf16' if dtype == torch.bfloat16 else 'fp32'} 2048^3): {peak / 1e9:.0f} GFLOP/s")
    print(
        f"{'system':<22} {'target tok/s':>12} {'ours / it':>9} {'GFLOP/s':>8} {'of peak':>7} {'system time':>11} "
        f"{'faults/update':>13}"
    )
    for name in systems:
        took = median_of(seconds[name])
        cpu = sum(u.user + u.system for u in usages[name])
        system_share = sum(u.system for u in usages[name]) / cpu
        faults = median_of([u.faults for u in usages[name]]) / args.steps
        print(
            f"{name:<22} {tokens / took:>12,.0f} {ours_speed / (tokens / took):>8.2f}x {flops / took / 1e9:>8.1f} "
            f"{100 * flops / took / peak:>6.0f}% {100 * system_share:>10.1f}% {faults:>13,.0f}"
        )


# ---------------------------------------------------------------- decoding


SYSTEMS = ["transformer_mt", "transformers generate", "CTranslate2 float32", "CTranslate2 int8"]


def decode_worker(system: str, ckpt: str, exported: dict, sources: list[str], singles: list[str]) -> dict:
    """One round of one system, in a fresh process: {"outputs": {beam: texts}, "seconds": {beam: s}, "latency": [ms]}.

    A process of its own, because two OpenMP runtimes in one process slow each other down for good:
    CTranslate2 brings its own libgomp, and after both had run, our one-sentence latency went from
    99 to 157-170 ms and CTranslate2's from 32 to 167 ms, pauses of seconds notwithstanding."""
    keep_freed_memory()
    if system == "transformer_mt":
        model, tokenizer, _ = load_for_inference(ckpt)

        def run(lines, beam):
            return translate_lines(model, tokenizer, lines, beam_size=beam, alpha=OUR_ALPHA)

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
            exported["ct2"], device="cpu", compute_type=kind, intra_threads=torch.get_num_threads()
        )
        # not load_for_inference: running torch before CTranslate2 in a process made CTranslate2 7x slower
        # (one sentence: 15 -> 103 ms), their two OpenMP thread pools competing for the cores
        sp = optional("sentencepiece").SentencePieceProcessor(model_file=f"{exported['ct2']}/sentencepiece.model")

        def run(lines, beam):
            return ct2_translate(translator, sp, lines, beam, HF_LENGTH_PENALTY)

    run(sources[:8], 4)  # warm-up
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
        sources, references = Path(args.src).read_text(encoding="utf-8").splitlines(), None
    sources, references = sources[: args.limit], references and references[: args.limit]
    by_length = sorted(sources, key=len)  # one-sentence latency: sentences of median length, each alone
    singles = by_length[len(by_length) // 2 - args.latency // 2 :][: args.latency]
    speed = {(name, beam): [] for name in SYSTEMS for beam in (4, 1)}
    latency = {name: [] for name in SYSTEMS}
    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        optional("ctranslate2")
        exported = {fmt: str(export(args.ckpt, fmt, f"{tmp}/{fmt}")) for fmt in ("hf", "ct2")}
        print(
            f"\ndecoding {len(sources)} sentences of {args.src} (median of {args.repeats} rounds, each system "
            f"in a fresh process), {args.ckpt}; latency: {len(singles)} median-length sentences one at a time, beam 4"
        )
        spawn = multiprocessing.get_context("spawn")
        for _ in range(args.repeats):
            for name in SYSTEMS:
                with ProcessPoolExecutor(1, mp_context=spawn) as pool:
                    result = pool.submit(decode_worker, name, args.ckpt, exported, sources, singles).result()
                for beam in (4, 1):
                    outputs[name, beam] = result["outputs"][beam]
                    speed[name, beam].append(len(sources) / result["seconds"][beam])
                latency[name] += result["latency"]
    print(f"{'system':<22} {'beam':>4} {'sent/s':>7} {'ours / it':>9} {'same as ours':>12} {'BLEU':>6} {'latency':>9}")
    for beam in (4, 1):
        ours = median_of(speed["transformer_mt", beam])
        for name in SYSTEMS:
            hyps = outputs[name, beam]
            same = sum(h == o for h, o in zip(hyps, outputs["transformer_mt", beam])) / len(hyps)
            bleu = f"{sacrebleu.corpus_bleu(hyps, [references]).score:6.2f}" if references else f"{'':>6}"
            lat = f"{median_of(latency[name]):>6.0f} ms" if beam == 4 else ""
            it = median_of(speed[name, beam])
            print(f"{name:<22} {beam:>4} {it:>7.1f} {ours / it:>8.2f}x {100 * same:>11.1f}% {bleu} {lat:>9}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", help="a trained checkpoint: decoding peers, and the tokenizer for real lengths")
    parser.add_argument("--src", help="source sentences: decoding input, and lengths for the training batches")
    parser.add_argument("--ref", help="references of --src: BLEU, and target lengths for the training batches")
    parser.add_argument("--shapes", default="small,base", help="model presets (conf/model) to train, comma-separated")
    parser.add_argument("--vocab", type=int, default=8000, help="vocabulary of the training shapes")
    parser.add_argument("--max-tokens", type=int, default=2048, help="padded tokens per side of a training batch")
    parser.add_argument("--steps", type=int, default=4, help="timed training updates per round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; every figure is the median")
    parser.add_argument("--limit", type=int, help="decode the first N sentences of --src only")
    parser.add_argument("--latency", type=int, default=10, help="sentences timed one at a time")
    parser.add_argument("--skip", choices=["training", "decoding"], help="leave one part out")
    args = parser.parse_args()
    kept = keep_freed_memory()  # as make train does, for every system in this process
    print(f"{machine()}; glibc malloc: {'no mmap, freed memory kept (allocator.py)' if kept else 'defaults'}")
    tokenizer = load_for_inference(args.ckpt)[1] if args.ckpt else None
    if args.skip != "training":
        dtype = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        pairs = length_pairs(args, tokenizer)
        for shape in args.shapes.split(","):
            bench_training(args, shape, pairs, dtype)
    if args.skip != "decoding":
        if not (args.ckpt and args.src):
            print("\ndecoding: skipped (give --ckpt and --src: make bench CKPT=... SRC=... [REF=...])")
        else:
            bench_decoding(args)
    print(
        f"\npeak resident memory of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
    )


if __name__ == "__main__":
    main()
