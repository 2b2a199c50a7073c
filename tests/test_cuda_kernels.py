"""Which kernels run the model on this GPU, and how fast: the SDPA backends of each attention call the model makes,
and a bf16 training update of the base model (tokens/s, share of the bf16 peak, memory). Skipped without a CUDA GPU;
`make gpu-check` runs them and shows each test's key figures."""

import contextlib
import gc
import math
import time
import warnings
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import train_in_process
from device_waits import WAITS_RUN, CudaWaits, counted_run, summary
from transformer_mt.configs import model_preset
from transformer_mt.data.batching import collate, update_shape
from transformer_mt.model import Transformer, TransformerConfig, training_flops
from transformer_mt.objective import sequence_losses
from transformer_mt.runtime import device_peak
from transformer_mt.tokenizer import PAD_ID
from transformer_mt.training.batch_fit import fit_max_tokens
from transformer_mt.training.module import TranslationModule

pytestmark = pytest.mark.cuda

BACKENDS = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """Hand the cached blocks back after each test: the entry-point tests' subprocesses need the GPU's memory."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def sentence_pairs(sentences: int, length: int, vocab: int, seed: int) -> dict:
    """A collate()d batch of random pairs of length - 5 .. length - 1 tokens (+ EOS), as a token bucket groups them."""
    g = torch.Generator().manual_seed(seed)

    def sentence() -> list[int]:
        n = int(torch.randint(length - 5, length, (1,), generator=g))
        return torch.randint(4, vocab, (n,), generator=g).tolist()  # ids 0-3 are PAD, UNK, BOS, EOS

    return collate([(sentence(), sentence(), i) for i in range(sentences)])


# ---------------------------------------------------------------- a training update of the base model


@pytest.mark.timeout(300)
def test_bf16_training_update_of_the_base_model(record_property):
    """The base recipe's update as data.max_tokens=auto shapes it on this GPU: the probe's micro-batch (WMT14's
    longest training pair, 251 tokens), as few micro-batches as make 25,000 tokens per side (batch_fit's
    update_shape; one on an H200), of sentences of 27-31 tokens (WMT14's median is ~30); a bare PyTorch loop, no
    Lightning, no loader, one wait per update: the upper bound the Trainer rows are compared with."""
    vocab, length, warmup, timed = 37000, 32, 3, 10
    torch.manual_seed(0)
    module = TranslationModule(model={**model_preset("base"), "vocab_size": vocab, "pad_id": PAD_ID}).cuda()
    max_tokens = fit_max_tokens(module, torch.device("cuda"), "bf16-mixed", longest=251)
    batch_tokens, micro_batches = update_shape(25_000, max_tokens, 1)
    sentences = batch_tokens // length
    model = module.model.train()
    optimizers = module.configure_optimizers()  # the project's fused Adam and Noam schedule
    optimizer, schedule = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
    batches = [sentence_pairs(sentences, length, vocab, seed) for seed in range(micro_batches)]
    tokens = sum(sum(b["tgt_lengths"]) for b in batches)  # target tokens of the whole update (real, with EOS)
    flops = sum(training_flops(model.cfg, b["src_lengths"], b["tgt_lengths"]) for b in batches)  # as training
    batches = [{key: b[key].cuda() for key in ("src", "tgt_in", "tgt_out", "target_positions")} for b in batches]
    torch.cuda.reset_peak_memory_stats()

    def update() -> tuple[float, float]:
        """One update over every micro-batch: (seconds, smoothed loss per target token)."""
        start = time.perf_counter()
        loss = torch.zeros((), device="cuda")
        for b in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss_sum, _, _ = sequence_losses(
                    model, b["src"], b["tgt_in"], b["tgt_out"], 0.1, b["target_positions"]
                )  # as training: the rows located by collate, no wait for the device
            (loss_sum / tokens).backward()  # per target token of the whole update, not per micro-batch
            loss += loss_sum.detach()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()  # the GPU's work is done before the clock stops
        return time.perf_counter() - start, loss.item() / tokens

    for _ in range(warmup):  # kernels chosen, allocator warm
        update()
    seconds, losses = zip(*(update() for _ in range(timed)))
    median = sorted(seconds)[timed // 2]
    name = torch.cuda.get_device_name()
    peak = device_peak(torch.device("cuda"), "bf16-mixed")  # what the training log's MFU uses
    share = f"MFU {peak.utilisation(flops / median):.1%} of {peak.source}" if peak.flops else peak.source
    memory = torch.cuda.max_memory_allocated() / 2**30
    figures = f"{tokens / median:,.0f} tgt tok/s, {share}, {memory:.1f} GiB; {micro_batches} x {batch_tokens:,} tokens"
    print(
        f"{sum(p.numel() for p in model.parameters()):,} parameters, vocab {vocab:,}, data.max_tokens=auto: "
        f"{max_tokens:,}; {micro_batches} micro-batch(es) of {sentences} x <= {length} tokens = {tokens:,} target "
        f"tokens per update, bf16 autocast; median of "
        f"{timed} updates {median * 1000:.0f} ms, {flops / median / 1e12:.1f} TFLOP/s; {name}; peak memory "
        f"{memory:.1f} GiB allocated; losses {', '.join(f'{x:.3f}' for x in losses)}"
    )
    record_property("figures", figures)
    # A fresh model predicts nearly uniformly: ~ln V per target token. Far from it, the normalisation is wrong.
    assert all(math.isfinite(x) and abs(x - math.log(vocab)) < 2 for x in losses), losses


def test_a_whole_training_run_on_the_gpu_waits_for_it_once_per_update(corpus, tmp_path, record_property):
    """test_module's whole-run rule, checked by CUDA itself (set_sync_debug_mode) over a short run of
    transformer_mt.train: validations, checkpoints, loggers at every update, 2 micro-batches per update."""
    counter = CudaWaits()
    args = [f"data.path={corpus}", "trainer=gpu", *WAITS_RUN]
    counted_run(counter, train_in_process, args, tmp_path, tmp_path / "run")
    updates = counter.per_update()
    record_property("figures", f"waits per update {[len(w) for w in updates.values()]}; {summary(counter)}")
    assert sorted(updates) == [1, 2, 3, 4, 5, 6], summary(counter)
    for update, waits in updates.items():
        assert len(waits) <= 1, (update, waits)


@pytest.mark.timeout(300)
def test_auto_batch_of_the_base_model_fits_the_gpu_with_its_optimizer_step(record_property):
    """data.max_tokens=auto's probe on the base model (bf16, sentences of 128 tokens), then a whole update
    at the size found: forward, backward and Adam's step stay within the GPU's memory."""
    vocab, length = 37000, 128
    torch.manual_seed(0)
    module = TranslationModule(model={**model_preset("base"), "vocab_size": vocab, "pad_id": PAD_ID}).cuda()
    tokens = fit_max_tokens(module, torch.device("cuda"), "bf16-mixed", longest=length)
    sentences = tokens // length
    optimizer = module.configure_optimizers()["optimizer"]
    ids = torch.randint(4, vocab, (sentences, length), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _, n = sequence_losses(module.model, ids, ids, ids, 0.1)
    (loss / n).backward()
    optimizer.step()
    torch.cuda.synchronize()
    peak, total = torch.cuda.max_memory_allocated(), torch.cuda.get_device_properties(0).total_memory
    record_property(
        "figures",
        f"max_tokens=auto: {tokens:,} ({sentences} x {length}), update peak "
        f"{peak / 2**30:.1f} of {total / 2**30:.1f} GiB",
    )
    assert sentences >= 1 and peak < total


# ---------------------------------------------------------------- which SDPA backends run the model's attention


@dataclass
class AttentionCall:
    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    backward: bool  # training calls are probed forward and backward

    def describe(self) -> str:
        shape = lambda t: "x".join(map(str, t.shape))  # noqa: E731
        mask = "none" if self.mask is None else f"{shape(self.mask)} bool"
        dtype = str(self.q.dtype).split(".")[1]
        return f"q {shape(self.q)}, k {shape(self.k)}, mask {mask}{', causal' if self.causal else ''}, {dtype}"


def attention_calls(model: Transformer, src: torch.Tensor, tgt_in: torch.Tensor) -> list[AttentionCall]:
    """The F.scaled_dot_product_attention calls of the model itself (one encoder and one decoder layer): a bf16
    training forward, and the third cached decoding step in fp32 (translate, evaluate) and in bf16 (validation)."""
    seen = []
    sdpa = F.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        seen.append((q.detach(), k.detach(), v.detach(), attn_mask, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    calls = []
    with mock.patch.object(F, "scaled_dot_product_attention", record), torch.no_grad():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(src, tgt_in)
        names = ["encoder self-attention", "decoder self-attention", "cross-attention"]
        calls += [AttentionCall(name, *args, backward=True) for name, args in zip(names, seen)]
        for dtype in (torch.float32, torch.bfloat16):
            seen.clear()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                state = model.start_decoding(*model.encode(src))
                for t in range(3):
                    model.decode_step(tgt_in[:, t], state)
            kind = str(dtype).split(".")[1]
            names = [f"decoding self-attention, cache ({kind})", f"decoding cross-attention ({kind})"]
            calls += [AttentionCall(name, *args, backward=False) for name, args in zip(names, seen[-2:])]
    return calls


def run_attention(call: AttentionCall, backend: SDPBackend | None) -> tuple[torch.Tensor | None, str]:
    """The call under one backend alone (None: PyTorch's own choice): its output, or None and why it cannot run."""
    q, k, v = (t.clone().requires_grad_(call.backward) for t in (call.q, call.k, call.v))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=call.mask, is_causal=call.causal)
                if call.backward:
                    out.float().square().sum().backward()
            torch.cuda.synchronize()
        except RuntimeError as e:  # PyTorch warns why each kernel was not used, then raises
            said = [str(w.message).split(" (Triggered internally")[0].strip().replace("\n", " ") for w in caught]
            reasons = [r for r in dict.fromkeys(said) if not r.endswith("because:")] or [str(e).replace("\n", " ")]
            return None, "; ".join(reasons)[:300]
    if call.backward and not all(torch.isfinite(t.grad).all() for t in (q, k, v)):
        return None, "non-finite gradients"
    return out.detach().float(), ""


def default_backend(call: AttentionCall) -> str:
    """The backend PyTorch itself picks (a private function: reported as ? if it moves, not a failure)."""
    q, k, v = (t.clone().requires_grad_(call.backward) for t in (call.q, call.k, call.v))
    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, attn_mask=call.mask, is_causal=call.causal)).name
    except Exception:
        return "?"


@pytest.mark.timeout(300)
def test_sdpa_backends_for_each_attention_call_agree_with_math(record_property):
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=1000, **{**model_preset("base"), "n_encoder_layers": 1, "n_decoder_layers": 1})
    model = Transformer(cfg).cuda().eval()
    batch = sentence_pairs(32, 30, 1000, seed=0)
    src, tgt_in = batch["src"].cuda(), batch["tgt_in"].cuda()
    src[::4, 20:] = PAD_ID  # more padding in some rows than token buckets leave: the mask must matter
    wrong, defaults, accepted = [], [], dict.fromkeys(BACKENDS, 0)
    table = [f"{'call':42s} {'default':10s} " + " ".join(f"{b.split('_')[0]:10s}" for b in BACKENDS)]
    calls = attention_calls(model, src, tgt_in)
    for call in calls:
        reference, why = run_attention(call, SDPBackend.MATH)
        assert reference is not None, f"{call.name}: the MATH backend refused it: {why}"
        # bf16 keeps 8 bits of mantissa: kernels that sum in another order differ by ~1% of the values' size
        tolerance = (1e-4 if call.q.dtype == torch.float32 else 2e-2) * (1 + reference.abs().max().item())
        cells, reasons = [], []
        for name in BACKENDS:
            out, why = run_attention(call, getattr(SDPBackend, name))
            if out is None:
                cells.append("no")
                reasons.append(f"{name}: {why}")
            elif (out - reference).abs().max().item() > tolerance:
                cells.append("WRONG")
                wrong.append(f"{call.name} on {name}")
            else:
                cells.append("yes")
                accepted[name] += 1
        if run_attention(call, None)[0] is None:
            wrong.append(f"{call.name} with no backend chosen")
        defaults.append(default_backend(call).split("_")[0])
        table.append(f"{call.name:42s} {defaults[-1]:10s} " + " ".join(f"{c:10s}" for c in cells))
        table += [f"  {call.describe()}", *(f"  {reason}" for reason in reasons)]
    print("\n".join(table))
    chosen = ", ".join(f"{name} {defaults.count(name)}" for name in sorted(set(defaults)))
    runs = ", ".join(f"{name.split('_')[0]} {n}/{len(calls)}" for name, n in accepted.items())
    figures = f"{len(calls)} calls; default {chosen}; run {runs}"
    record_property("figures", figures)
    assert not wrong, f"{figures}; wrong or failing: {', '.join(wrong)}"
