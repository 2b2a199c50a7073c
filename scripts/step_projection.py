"""The training step on a GPU, projected from counts made on this CPU (no GPU needed): per micro-batch, the FLOPs of
matrix products and attention, and the bytes every other operation reads and writes, eager and compiled; then the
time on a named GPU and the target tokens/s it gives.

  .venv/bin/python scripts/step_projection.py --shapes base --gpu H200

How it counts. One forward and backward of the model (conf/model preset, bf16 autocast as trainer.precision=bf16-mixed,
dropout on, the training loss: objective.sequence_losses) on real CPU tensors of two small micro-batches of
sentences of --length tokens, at 1 and 2 layers a side; every count is linear in the number of sentences (attention
too: the length is fixed) and in the layers (alike), so these four give the count at the model's depth and the
micro-batch asked for (--tokens padded tokens per side, --real of them real target tokens: the rows the loss
projects).
- eager: a dispatch mode sees every operation: matrix products and attention add their FLOPs (torch's flop
  formulas); every other operation that is not a view adds the bytes of its inputs and outputs. Inside
  F.linear_cross_entropy's chunked op (a custom op) it counts the operations its Python kernel runs. The loss alone
  (from the hidden rows it projects) is counted the same way.
- compiled: torch.compile (inductor) of the same step; inductor's own count of the bytes each generated kernel
  reads and writes (GraphLowering.count_bytes), the kernels it calls out to (matrix products, attention) left out.
  Inductor's CPU code generation fuses as its GPU code generation does for these operations (pointwise and
  reductions into one loop); the counts are a projection, not a GPU measurement. Inductor calls the chunked op as
  it is (as it calls a matrix product): what it moves inside is the eager count's.
Time = FLOPs / (peak x --matmul-efficiency) + bytes / (bandwidth x --bandwidth-efficiency); the defaults (0.6 of
the bf16 peak, 0.62 of the HBM bandwidth: 3 TB/s on an H200) are what the GPU-step issue's projection used.
--loss reference replaces the chunked loss with label_smoothed_nll of the logits (the loss before it) for comparison.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch._functorch.config
import torch._inductor.compile_fx
import torch._inductor.config
import torch._inductor.graph
import torch._inductor.metrics
import torch.nn.functional as F
import torch.nn.modules.linear_cross_entropy as lce
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from transformer_mt.configs import model_preset
from transformer_mt.model import Transformer, TransformerConfig
from transformer_mt.objective import label_smoothed_nll, linear_smoothed_nll, sequence_losses

SIZES = (8, 16)  # sentences of the counted micro-batches
# (HBM bytes/s, dense bf16 FLOP/s) from NVIDIA's data sheets (SXM parts)
GPUS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.0e12, 312e12)}
aten = torch.ops.aten
# The CPU's fused attention has the FLOPs of the GPU's flash attention, whose formulas torch registers.
FLOP_FORMULAS = {
    **flop_registry,
    aten.addmm_: flop_registry[aten.addmm],  # the chunked loss's weight gradient, accumulated in place
    aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[aten._scaled_dot_product_flash_attention],
    aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_registry[
        aten._scaled_dot_product_flash_attention_backward
    ],
}


# Operations that read only the elements an index names: (output or source) elements moved twice, plus the index.
INDEXED = {aten.gather, aten.index_select, aten.scatter, aten.scatter_, aten.scatter_add, aten.scatter_add_}
INDEXED.add(aten.index_add_)  # the chunked loss's rows of W's gradient at the targets
ALLOCATIONS = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided}


# F.linear_cross_entropy's chunked op and its Python kernel, which the counter calls itself to see the kernel's calls.
# Private names: torch has no public handle on a custom op's implementation.
CHUNKED_LOSS = torch.ops.torch_nn._linear_cross_entropy_batch_chunked
CHUNKED_LOSS_KERNEL = lce._linear_cross_entropy_batch_chunked._init_fn


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Counter(TorchDispatchMode):
    """FLOPs of matrix products and attention; bytes read and written by every other operation but views and
    allocations: each input once (an out= argument is written, not read), each output once; an indexed read or
    write moves only the elements it names."""

    def __init__(self):
        super().__init__()
        self.flops, self.bytes, self.inside = 0, 0, 0  # inside: bytes moved inside the chunked loss

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket == CHUNKED_LOSS:  # its kernel's operations, not the op
            before = self.bytes
            with self:  # this mode is off while it handles an op: on again for the kernel's calls
                out = CHUNKED_LOSS_KERNEL(*args, **kwargs)
            self.inside += self.bytes - before
            return out
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        formula = FLOP_FORMULAS.get(packet) or FLOP_FORMULAS.get(func)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        elif packet in INDEXED:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            index = next(t for t in tensors if not t.is_floating_point())
            moved = nbytes(out) if packet in (aten.gather, aten.index_select) else nbytes(tensors[-1])
            copy = 2 * nbytes(out) if packet in (aten.scatter, aten.scatter_add) else 0  # out of place: self copied
            self.bytes += 2 * moved + nbytes(index) + copy
        elif not func.is_view and packet not in ALLOCATIONS:
            inputs = [t for t in tree_leaves((args, {k: v for k, v in kwargs.items() if k != "out"}))]
            outputs = [t for t in tree_leaves(out)]
            self.bytes += sum(nbytes(t) for t in inputs + outputs if isinstance(t, torch.Tensor))
        return out


class InductorBytes:
    """Bytes that inductor's generated kernels read and write (extern kernels, i.e. matrix products and attention,
    left out), summed over the graphs compiled while it is active."""

    def __enter__(self):
        self.bytes = 0
        self.original = torch._inductor.graph.GraphLowering.count_bytes
        counter = self

        def count_bytes(graph):
            from torch._inductor.scheduler import ExternKernelSchedulerNode  # noqa: PLC0415

            kernels = [n for n in graph.scheduler.nodes if not isinstance(n, ExternKernelSchedulerNode)]
            counter.bytes += sum(n.get_read_write_buffers_sizes() for n in kernels)
            return counter.original(graph)

        torch._inductor.graph.GraphLowering.count_bytes = count_bytes
        torch._inductor.config.fx_graph_cache = False  # a graph from the cache is not generated, so not counted
        torch._functorch.config.enable_autograd_cache = False
        torch._logging.set_logs(inductor_metrics=True)  # inductor counts only where it logs its metrics
        self.log = torch._inductor.compile_fx.inductor_metrics_log
        self.log.propagate = False  # counted, not printed
        return self

    def __exit__(self, *exc):
        torch._inductor.graph.GraphLowering.count_bytes = self.original
        self.log.propagate = True
        torch._logging.set_logs()


def reference_losses(model, src, tgt_in, tgt_out, epsilon, positions):
    """sequence_losses with label_smoothed_nll of the logits (fp32 log-probabilities kept), the loss before."""
    hidden = model.features(src, tgt_in)
    logits = model.project(hidden.flatten(0, 1).index_select(0, positions))
    return label_smoothed_nll(logits, tgt_out.flatten().index_select(0, positions), epsilon)


def micro_batch(cfg: TransformerConfig, sentences: int, length: int, real_share: float) -> tuple:
    """Random ids, (sentences, length) per side; the first real_share of the target positions are the loss's rows."""
    g = torch.Generator().manual_seed(sentences)
    src = torch.randint(4, cfg.vocab_size, (sentences, length), generator=g)
    tgt = torch.randint(4, cfg.vocab_size, (sentences, length), generator=g)
    positions = torch.arange(round(sentences * length * real_share))
    return src, tgt, tgt, positions


def count_step(model, batch, losses, mode: str) -> tuple[int, int, int]:
    """(FLOPs, bytes of the whole step, bytes of the loss alone) of one forward and backward, eager or compiled
    (FLOPs: 0, compiling changes no matrix product)."""
    model.zero_grad(set_to_none=True)
    with counting(mode) as counter, torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, _ = compiled(losses, mode)(model, *batch[:3], 0.1, batch[3])
        loss.backward()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the loss alone, from the same hidden rows
        hidden = model.features(*batch[:2]).flatten(0, 1).index_select(0, batch[3])
    target = batch[2].flatten().index_select(0, batch[3])
    loss_alone = reference_loss if losses is reference_losses else linear_smoothed_nll
    inside = 0 if mode == "eager" else loss_bytes(loss_alone, hidden, model.output_weight, target, "eager", True)
    loss_moved = loss_bytes(loss_alone, hidden, model.output_weight, target, mode)
    return getattr(counter, "flops", 0), counter.bytes + inside, loss_moved + inside


def reference_loss(hidden, weight, target, epsilon):
    return label_smoothed_nll(F.linear(hidden, weight), target, epsilon)


def loss_bytes(loss, hidden, weight, target, mode: str, inside: bool = False) -> int:
    """Bytes moved by loss(hidden, weight, target, 0.1) (linear_smoothed_nll or reference_loss) and its backward
    under bf16 autocast; inside: only those moved inside the chunked loss (eager)."""
    hidden, weight = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)  # no .grad to add to
    with counting(mode) as counter, torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(loss, mode)(hidden, weight, target, 0.1)[0].backward()
    return counter.inside if inside else counter.bytes


def compiled(fn, mode: str):
    if mode == "eager":
        return fn
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def counting(mode: str) -> Counter | InductorBytes:
    return Counter() if mode == "eager" else InductorBytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="base", help="model presets (conf/model), comma-separated")
    parser.add_argument("--vocab", type=int, default=37_000, help="vocabulary (WMT14's shared SentencePiece: 37,000)")
    parser.add_argument("--tokens", type=int, default=25_000, help="padded tokens per side of the micro-batch")
    parser.add_argument("--real", type=int, default=22_000, help="real target tokens among them (the loss's rows)")
    parser.add_argument("--length", type=int, default=25, help="tokens per sentence and side")
    parser.add_argument("--gpu", default="H200", choices=sorted(GPUS))
    parser.add_argument("--matmul-efficiency", type=float, default=0.6)
    parser.add_argument("--bandwidth-efficiency", type=float, default=0.62)
    parser.add_argument("--loss", default="chunked,reference", help="chunked (linear_smoothed_nll), reference, or both")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="eager counts only")
    args = parser.parse_args()
    bandwidth, peak = GPUS[args.gpu]
    bandwidth, peak = bandwidth * args.bandwidth_efficiency, peak * args.matmul_efficiency
    sentences = args.tokens / args.length  # in the micro-batch asked for
    print(
        f"projected on {args.gpu}: {bandwidth / 1e12:.2f} TB/s and {peak / 1e12:.0f} TFLOP/s effective; micro-batch "
        f"{args.tokens:,} padded tokens per side ({sentences:.0f} sentences of {args.length}), {args.real:,} real "
        f"target tokens, vocabulary {args.vocab:,}, bf16 autocast",
        flush=True,
    )
    for shape in args.shapes.split(","):
        cfg = TransformerConfig(**model_preset(shape), vocab_size=args.vocab, pad_id=0)
        for loss_name in args.loss.split(","):
            losses = sequence_losses if loss_name == "chunked" else reference_losses
            flops = None  # the eager count's: compiling changes no matrix product
            for mode in ("eager", "compiled") if args.compile else ("eager",):
                eager_flops, moved, loss_moved = projected(cfg, losses, mode, sentences, args)
                flops = flops or eager_flops
                seconds = flops / peak + moved / bandwidth
                print(
                    f"  {shape:5} {loss_name:9} {mode:8}: matrix products and attention {flops / 1e12:5.2f} TFLOP "
                    f"({flops / peak * 1e3:5.1f} ms), memory-bound {moved / 1e9:6.1f} GB "
                    f"({moved / bandwidth * 1e3:5.1f} ms), the loss {loss_moved / 1e9:5.1f} GB of it; "
                    f"{seconds * 1e3:5.1f} ms, {args.real / seconds / 1e6:.2f}M target tok/s",
                    flush=True,
                )


def projected(cfg: TransformerConfig, losses, mode: str, sentences: float, args) -> list[float]:
    """count_step at 1 and 2 layers a side and at SIZES sentences, extrapolated to cfg's layers and `sentences`:
    every count is linear in each (the layers are alike; the length is fixed), and compiling 2 layers instead of
    6 or 12 keeps inductor's part to minutes."""
    if cfg.n_encoder_layers != cfg.n_decoder_layers:
        raise SystemExit(f"{cfg.n_encoder_layers} encoder and {cfg.n_decoder_layers} decoder layers: not projected")
    counts = {}
    for layers in (1, 2):
        shallow = dataclasses.replace(cfg, n_encoder_layers=layers, n_decoder_layers=layers)
        model = Transformer(shallow).train()
        for n in SIZES:
            counts[layers, n] = count_step(
                model, micro_batch(shallow, n, args.length, args.real / args.tokens), losses, mode
            )
    by_layers = [
        [line(sentences, SIZES, a, b) for a, b in zip(counts[layers, SIZES[0]], counts[layers, SIZES[1]])]
        for layers in (1, 2)
    ]
    return [line(cfg.n_encoder_layers, (1, 2), a, b) for a, b in zip(*by_layers)]


def line(x: float, at: tuple[int, int], y0: float, y1: float) -> float:
    return y0 + (y1 - y0) * (x - at[0]) / (at[1] - at[0])


if __name__ == "__main__":
    main()
