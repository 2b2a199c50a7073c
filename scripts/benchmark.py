"""Training and decoding speed of our model against peers in the same run (medians).

  python scripts/benchmark.py                       # small model (CPU-sized), bf16 autocast on CPU
  python scripts/benchmark.py --model base --device cuda

Training peer: torch.nn.Transformer (post-norm, ReLU) with the same sizes, our embedding and
tied projection, the same loss and fused Adam. Decoding peer: greedy decoding by full
recomputation at every step (no cache). Prints target tokens/s, sentences/s and peak memory.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
from omegaconf import OmegaConf

from transformer_mt.config import CONF_DIR
from transformer_mt.model import Transformer, TransformerConfig
from transformer_mt.module import label_smoothed_nll
from transformer_mt.search import beam_search, greedy, pad_sources
from transformer_mt.tokenizer import BOS_ID, EOS_ID, PAD_ID


class TorchPeer(torch.nn.Module):
    """torch.nn.Transformer with our embedding/positions and tied output projection."""

    def __init__(self, ours: Transformer):
        super().__init__()
        cfg = ours.cfg
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

    def features(self, src, tgt_in):
        causal = torch.ones(tgt_in.size(1), tgt_in.size(1), dtype=torch.bool, device=src.device).triu(1)
        pad = src.eq(PAD_ID)
        return self.stack(
            self.embed(src), self.embed(tgt_in), tgt_mask=causal, src_key_padding_mask=pad, memory_key_padding_mask=pad
        )

    def project(self, h):
        return h @ self.embed.tokens.weight.T


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS


def synthetic_batch(batch: int, length: int, vocab: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
    rows = [torch.randint(4, vocab, (int(n),), generator=g).tolist() for n in lengths]
    src = pad_sources(rows, device)
    tgt_out = pad_sources(rows, device)  # ids + EOS
    tgt_in = torch.cat([torch.full_like(tgt_out[:, :1], BOS_ID), tgt_out[:, :-1]], 1).masked_fill(
        tgt_out.eq(PAD_ID), PAD_ID
    )
    return src, tgt_in, tgt_out


def train_speed(model, batch, steps, autocast_dtype, device) -> float:
    src, tgt_in, tgt_out = batch
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    keep = tgt_out.ne(PAD_ID)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            hidden = model.features(src, tgt_in)
            loss, _, n = label_smoothed_nll(model.project(hidden[keep]), tgt_out[keep], 0.1)
        (loss / n).backward()
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return keep.sum().item() / statistics.median(times[2:])


@torch.no_grad()
def uncached_greedy(model: Transformer, src, max_len: int) -> list[list[int]]:
    prefix = torch.full((src.size(0), 1), BOS_ID, dtype=torch.long, device=src.device)
    done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
    for _ in range(max_len):
        logits = model(src, prefix)[:, -1]
        logits[:, PAD_ID] = -torch.inf
        nxt = logits.argmax(-1).masked_fill(done, PAD_ID)
        prefix = torch.cat([prefix, nxt[:, None]], 1)
        done |= nxt.eq(EOS_ID)
        if done.all():
            break
    return prefix[:, 1:].tolist()


def decode_speed(fn, repeats: int, n_sentences: int, device) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return n_sentences / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="a preset of conf/model")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=200, help="sentences per training batch")
    parser.add_argument("--length", type=int, default=20, help="longest sentence (tokens)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.precision == "bf16" else None
    preset = OmegaConf.to_container(OmegaConf.load(f"{CONF_DIR}/model/{args.model}.yaml"))
    torch.manual_seed(0)
    ours = Transformer(TransformerConfig(vocab_size=args.vocab, **preset)).to(device)
    peer = TorchPeer(Transformer(TransformerConfig(vocab_size=args.vocab, **preset))).to(device)
    batch = synthetic_batch(args.batch, args.length, args.vocab, device)
    print(
        f"model {args.model} ({sum(p.numel() for p in ours.parameters()):,} parameters), vocab {args.vocab}, "
        f"{args.batch} sentences of <= {args.length} tokens, {args.precision}, {device}, "
        f"{torch.get_num_threads()} threads; medians of {args.steps - 2} steps"
    )
    for name, model in [("transformer_mt", ours), ("torch.nn.Transformer", peer)]:
        model.train()
        print(f"train  {name:22s} {train_speed(model, batch, args.steps, dtype, device):9,.0f} target tokens/s")
    ours.eval()
    src = synthetic_batch(64, args.length, args.vocab, device, seed=1)[0]
    limit = args.length + 10
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        runs = [
            ("greedy, cached", lambda: greedy(ours, src, 0.0, limit)),
            ("greedy, uncached", lambda: uncached_greedy(ours, src, limit)),
            ("beam 4, cached", lambda: beam_search(ours, src, 4, 0.6, 0.0, limit)),
        ]
        for name, fn in runs:
            print(f"decode {name:22s} {decode_speed(fn, 3, src.size(0), device):9,.1f} sentences/s")
    print(
        f"peak memory {peak_memory_mb(device):,.0f} MiB ({'GPU allocated' if device.type == 'cuda' else 'process RSS'})"
    )


if __name__ == "__main__":
    main()
