"""Does every GPU path work on this machine? One run, at most ~8 minutes on one GPU.

  make gpu-check                           # python scripts/gpu_check.py
  make gpu-check ARGS="--multi30k DIR"     # Multi30k text files (default: ../shared/data/multi30k, else the Hub)
  make gpu-check ARGS="--device cpu"       # no GPU: the same code paths on the CPU, tiny sizes

Checks, each on its own (a failing check is reported and the others still run):
  1. cuda tests         the test suite's tests marked `cuda` (pytest -m cuda)
  2. training step      the base model (conf/model/base.yaml) in bf16: target tokens/s, share of the bf16 peak, memory
  3. multi30k training  `experiment=multi30k trainer=gpu` for 200 updates through the training entry point:
                        the logged training loss must fall
  4. ddp/fsdp+translate trainer=ddp and trainer=fsdp on one GPU, 20 updates each, then `transformer_mt.translate`
                        with each run's checkpoint must print a translation for every input line
  5. beam gpu = cpu     beam search on the GPU gives the CPU's tokens for the same weights (fp32)
  6. sdpa kernels       which SDPA backends accept each attention call the model makes, and agree with MATH
A summary table ends the output; the exit status is 1 if any check failed. Without a CUDA GPU the script
says so and checks nothing (exit 0), unless given --device cpu.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from unittest import mock

import lightning
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.nn.attention import SDPBackend, sdpa_kernel

from transformer_mt.checkpoint import load_for_inference
from transformer_mt.configs import CONF_DIR
from transformer_mt.model import Transformer, TransformerConfig
from transformer_mt.objective import label_smoothed_nll
from transformer_mt.search import pad_sources, translate_ids
from transformer_mt.tokenizer import BOS_ID, PAD_ID
from transformer_mt.training.module import TranslationModule


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated by torch, or on the CPU the process's peak resident memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


ROOT = Path(__file__).resolve().parents[1]
SHARED_MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"

# NVIDIA's dense (no sparsity) bf16 tensor-core peaks, FLOP/s, by device name. H100/H200 are the SXM parts;
# PCIe and NVL parts run lower clocks and are left unknown rather than guessed.
BF16_PEAK = [
    (r"H[12]00(?!.*(PCIe|NVL))", 989e12),
    (r"A100", 312e12),
    (r"L40S", 362e12),
    (r"\bL4\b", 121e12),
    (r"RTX 4090", 165e12),
]

# The plumbing mode (--device cpu): a tiny model, fp32, small batches; the rest as on a GPU.
TINY_MODEL = dict(d_model=32, d_ff=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=2)
TINY_RUN = [
    "trainer=cpu",
    "trainer.precision=32-true",
    *(f"model.{key}={value}" for key, value in TINY_MODEL.items()),
    "data.vocab_size=400",
    "data.max_tokens=512",
    "val_bleu_sentences=20",
]
SENTENCES = [  # check 4 translates these
    "A man in a blue shirt is standing on a ladder.",
    "Two dogs are playing in the snow.",
    "A group of people are sitting at a table in a restaurant.",
    "A little girl climbs into a wooden playhouse.",
    "The woman is riding a bicycle down the street.",
]


class Skip(Exception):
    """The check cannot run here; the message says why."""


class CheckFailed(Exception):
    """The check ran and its result is wrong; the message is its key figure."""


@dataclass
class Plan:
    """What the checks run on and share: full sizes on a GPU, tiny ones in the CPU plumbing mode."""

    device: torch.device
    updates: int  # check 3
    steps: int  # check 2: timed updates
    multi30k: Path | None  # None: the Hub
    workdir: Path
    checkpoint: Path | None = None  # check 3's last.ckpt, which check 5 decodes with

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def train_command(self, run_dir: Path, *overrides: str, trainer: str = "gpu") -> list[str]:
        """The Multi30k recipe through the real entry point, with a CSV log in run_dir; on the CPU, TINY_RUN's."""
        return [
            sys.executable,
            "-m",
            "transformer_mt.train",
            "experiment=multi30k",
            *([f"trainer={trainer}"] if self.cuda else TINY_RUN),
            "logger=csv",
            "trainer.enable_progress_bar=false",
            *([f"data.path={self.multi30k}"] if self.multi30k else []),
            f"hydra.run.dir={run_dir}",
            *overrides,
        ]


def run_entry_point(cmd: list[str], timeout: float, stdin: str | None = None, cwd: Path | None = None):
    """Run a command as a user does; a failure ends the check with its last error line and shows its output's tail."""
    shown = [Path(cmd[0]).name, *cmd[1:]] if cmd[0] == sys.executable else cmd
    print("  $ " + " ".join(shown), flush=True)
    try:
        proc = subprocess.run(
            cmd,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd or ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"{' '.join(shown[:3])} did not finish within {timeout:.0f} s") from None
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).rstrip().splitlines()
        print("\n".join("  | " + line for line in lines[-20:]))
        last = next((line for line in reversed(proc.stderr.splitlines()) if line.strip()), "")
        raise CheckFailed(f"exit status {proc.returncode}: {last.strip()[:160]}")
    return proc


# ---------------------------------------------------------------- 1. the tests marked cuda


def check_cuda_tests(plan: Plan) -> str:
    if not plan.cuda:
        raise Skip("needs a CUDA GPU")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "cuda", "tests/", "-q", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    print("\n".join("  | " + line for line in proc.stdout.rstrip().splitlines()[-25:]))
    counts = {kind: 0 for kind in ("passed", "failed", "error", "skipped")}
    last_line = (proc.stdout.strip().splitlines() or [""])[-1]  # "3 passed, 1 failed in 12.3s"
    for number, kind in re.findall(r"(\d+) (passed|failed|errors?|skipped)", last_line):
        counts[kind.rstrip("s") if kind.startswith("error") else kind] += int(number)
    figures = (
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, {counts['skipped']} skipped"
    )
    if proc.returncode != 0 or counts["passed"] == 0 or counts["skipped"]:
        raise CheckFailed(figures + ("" if proc.returncode in (0, 1) else f" (pytest exit status {proc.returncode})"))
    return figures


# ---------------------------------------------------------------- 2. a training step of the base model


def bf16_peak(device_name: str) -> float | None:
    return next((peak for pattern, peak in BF16_PEAK if re.search(pattern, device_name)), None)


def token_batch(sentences: int, length: int, vocab: int, device: torch.device, seed: int):
    """(src, tgt_in, tgt_out) of sentences with lengths near `length` (with EOS), as token buckets group them."""
    g = torch.Generator().manual_seed(seed)

    def side() -> torch.Tensor:
        lengths = torch.randint(length - 5, length, (sentences,), generator=g)
        return pad_sources([torch.randint(4, vocab, (int(n),), generator=g).tolist() for n in lengths], device)

    src, tgt_out = side(), side()
    tgt_in = torch.cat([torch.full_like(tgt_out[:, :1], BOS_ID), tgt_out[:, :-1]], 1)
    return src, tgt_in.masked_fill(tgt_out.eq(PAD_ID), PAD_ID), tgt_out


def training_flops(model: Transformer, src: torch.Tensor, tgt_out: torch.Tensor) -> float:
    """Model FLOPs of one forward + backward pass over a batch: useful work only, padding excluded.

    Each weight costs 6 FLOPs per token that passes through it (2 forward, 4 backward), and the
    attention products QK^T and AV 2 * 2 * d per query-key pair forward, so 12 * d in training:

      6 * (P_enc * N_src + (P_dec - P_kv) * N_tgt + P_kv * N_src + d * V * N_tgt)
        + 12 * d * sum over sentences of (L_enc * S^2 + L_dec * (T (T + 1) / 2 + T * S))

    P_enc, P_dec: non-embedding parameters of the encoder and decoder layers; P_kv: the decoder's
    cross-attention key/value projections, which run over the source. d * V is the output projection:
    tied to the embedding (§3.4), so not a parameter of its own, but a real matrix product. The
    decoder's self-attention is causal: a target position sees T(T+1)/2 keys in all.
    """
    cfg = model.cfg
    count = lambda modules: sum(p.numel() for m in modules for p in m.parameters())  # noqa: E731
    p_enc, p_dec = count(model.encoder_layers), count(model.decoder_layers)
    p_kv = count(m for layer in model.decoder_layers for m in (layer.cross_attn.k_proj, layer.cross_attn.v_proj))
    S, T = src.ne(PAD_ID).sum(1).double(), tgt_out.ne(PAD_ID).sum(1).double()  # real lengths per sentence
    n_src, n_tgt = S.sum().item(), T.sum().item()
    weights = 6 * (p_enc * n_src + (p_dec - p_kv) * n_tgt + p_kv * n_src + cfg.d_model * cfg.vocab_size * n_tgt)
    pairs = cfg.n_encoder_layers * S**2 + cfg.n_decoder_layers * (T * (T + 1) / 2 + T * S)
    return weights + 12 * cfg.d_model * pairs.sum().item()


def check_training_step(plan: Plan) -> str:
    if plan.cuda:  # the base recipe on one GPU: accumulation 7 x max_tokens 4096 (README), ~27k target tokens
        model_cfg = OmegaConf.to_container(OmegaConf.load(f"{CONF_DIR}/model/base.yaml"))
        vocab, micro_batches, sentences, length, warmup = 37000, 7, 128, 32, 3
    else:
        model_cfg, vocab, micro_batches, sentences, length, warmup = TINY_MODEL, 400, 2, 16, 12, 1
    torch.manual_seed(0)
    module = TranslationModule(model={**model_cfg, "vocab_size": vocab, "pad_id": PAD_ID}).to(plan.device)
    model = module.model.train()
    optimizers = module.configure_optimizers()  # the project's fused Adam and Noam schedule
    optimizer, schedule = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
    batches = [token_batch(sentences, length, vocab, plan.device, seed) for seed in range(micro_batches)]
    dtype = torch.bfloat16 if plan.cuda else torch.float32
    if plan.cuda:
        torch.cuda.reset_peak_memory_stats(plan.device)

    def update() -> float:
        start = time.perf_counter()
        for src, tgt_in, tgt_out in batches:
            with torch.autocast(plan.device.type, dtype=dtype, enabled=plan.cuda):
                keep = tgt_out.ne(PAD_ID)
                loss_sum, _, n = label_smoothed_nll(
                    model.project(model.features(src, tgt_in)[keep]), tgt_out[keep], 0.1
                )
            (loss_sum / n / micro_batches).backward()  # per target token, averaged over micro-batches as Lightning does
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if plan.cuda:
            torch.cuda.synchronize()
        if not torch.isfinite(loss_sum):
            raise CheckFailed(f"the loss is {loss_sum.item()}")
        return time.perf_counter() - start

    for _ in range(warmup):
        update()
    seconds = sorted(update() for _ in range(plan.steps))[plan.steps // 2]  # the median update
    tokens = sum(tgt_out.ne(PAD_ID).sum().item() for _, _, tgt_out in batches)
    flops = sum(training_flops(model, src, tgt_out) for src, _, tgt_out in batches)
    name = torch.cuda.get_device_name(plan.device) if plan.cuda else "CPU"
    peak = bf16_peak(name) if plan.cuda else None
    share = f"{flops / seconds / peak:.1%} of the bf16 peak" if peak else "peak unknown"
    memory = peak_memory_mb(plan.device) / 1024
    print(
        f"  {sum(p.numel() for p in model.parameters()):,} parameters, vocab {vocab:,}, {micro_batches} micro-batches "
        f"of {sentences} x <= {length} tokens = {tokens:,} target tokens per update, {str(dtype).split('.')[1]}; "
        f"median of {plan.steps} updates: {seconds * 1000:.0f} ms, {flops / seconds / 1e12:.1f} TFLOP/s ({share}), "
        f"peak memory {memory:.1f} GiB ({'GPU allocated' if plan.cuda else 'process RSS'})"
    )
    return f"{tokens / seconds:,.0f} tgt tok/s, {share}, {memory:.1f} GiB"


# ---------------------------------------------------------------- 3. Multi30k through the training entry point


def logged_losses(run_dir: Path) -> list[float]:
    """train/loss of every logged step, from the CSV logger's metrics.csv."""
    with open(run_dir / "csv" / "version_0" / "metrics.csv", newline="") as f:
        return [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]


def check_multi30k(plan: Plan) -> str:
    run_dir = plan.workdir / "multi30k"
    overrides = [
        f"trainer.max_steps={plan.updates}",
        f"trainer.log_every_n_steps={max(plan.updates // 20, 1)}",
        f"trainer.val_check_interval={plan.updates}",  # one validation, at the end
        f"progress_every_n_updates={max(plan.updates // 4, 1)}",
    ]
    if not plan.cuda:  # a few updates only: warm up within them
        overrides.append(f"optim.warmup_steps={max(plan.updates // 3, 1)}")
    proc = run_entry_point(plan.train_command(run_dir, *overrides), timeout=420, cwd=plan.workdir)
    plan.checkpoint = run_dir / "checkpoints" / "last.ckpt"
    losses = logged_losses(run_dir)
    if len(losses) < 4:
        raise CheckFailed(f"only {len(losses)} training losses logged in {run_dir}/csv")
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2  # two logged steps each: batches differ in length
    speed = re.findall(r"[\d,]+ target tok/s", proc.stdout)  # from the progress lines
    bleu = [
        line.split("greedy sacreBLEU ")[1].split(",")[0] for line in proc.stdout.splitlines() if "sacreBLEU" in line
    ]
    figures = (
        f"loss {first:.2f} -> {last:.2f} in {plan.updates} updates"
        + (f", val BLEU {bleu[-1]}" if bleu else "")
        + (f", {speed[-1]}" if speed else "")
    )
    if not last < 0.85 * first:
        raise CheckFailed(figures + " (expected at least 15% lower)")
    return figures


# ---------------------------------------------------------------- 4. DDP and FSDP on one GPU, then translate


def check_parallel(plan: Plan, strategy: str) -> str:
    if strategy == "fsdp" and not plan.cuda:
        raise Skip("FSDP needs CUDA (Lightning refuses it on a CPU accelerator)")
    run_dir, updates = plan.workdir / strategy, 20
    overrides = [
        "trainer.devices=1",
        f"trainer.max_steps={updates}",
        f"trainer.val_check_interval={updates}",  # one validation (greedy decoding under the strategy), at the end
        *(["val_bleu_sentences=100"] if plan.cuda else [f"trainer.strategy={strategy}"]),
    ]
    command = plan.train_command(run_dir, *overrides, trainer=strategy)
    run_entry_point(command, timeout=300, cwd=plan.workdir)
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    # Greedy: 20 updates leave a model close to its random start, whose outputs are long strings of pieces; beam
    # search may rank an immediate EOS first for some inputs (an empty line). Beam search is check 5's.
    translate = [
        sys.executable,
        "-m",
        "transformer_mt.translate",
        f"ckpt={checkpoint}",
        f"device={plan.device.type}",
        "decoding=greedy",
    ]
    proc = run_entry_point(translate, timeout=180, stdin="\n".join(SENTENCES) + "\n", cwd=plan.workdir)
    lines = proc.stdout.split("\n")[:-1]
    for source, line in zip(SENTENCES, lines):
        print(f"  {source} -> {line[:100]}")
    figures = f"{updates} updates; {sum(map(bool, lines))}/{len(SENTENCES)} lines translated"
    if len(lines) != len(SENTENCES) or not all(line.strip() for line in lines):
        raise CheckFailed(figures + f" ({len(lines)} output lines)")
    return figures


# ---------------------------------------------------------------- 5. beam search: the GPU against the CPU


def check_beam(plan: Plan) -> str:
    n = 100 if plan.cuda else 8
    if plan.checkpoint and plan.checkpoint.is_file():
        model, tokenizer, _ = load_for_inference(plan.checkpoint)
        test_file = plan.multi30k / "test_2016_flickr.en" if plan.multi30k else None
        if test_file and test_file.is_file():
            sources = tokenizer.encode(test_file.read_text(encoding="utf-8").split("\n")[:n])
            origin = f"check 3's checkpoint, {test_file.name}"
        else:
            sources = None
            origin = "check 3's checkpoint, random sources"
    else:
        torch.manual_seed(0)
        model_cfg = OmegaConf.to_container(OmegaConf.load(f"{CONF_DIR}/model/small.yaml")) if plan.cuda else TINY_MODEL
        model = Transformer(TransformerConfig(vocab_size=5000, **model_cfg)).eval()
        sources, origin = None, "random weights (no checkpoint from check 3)"
    if sources is None:
        g = torch.Generator().manual_seed(0)
        vocab = model.cfg.vocab_size
        sources = [
            torch.randint(4, vocab, (int(k),), generator=g).tolist() for k in torch.randint(3, 30, (n,), generator=g)
        ]
    sources = [ids[: model.cfg.max_positions - 1] or [4] for ids in sources]
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # fp32 means fp32 here: no TF32 on the GPU
    try:
        decode = partial(translate_ids, sources=sources, beam_size=4, alpha=0.6)
        on_cpu = decode(model.float().cpu())
        on_device = decode(copy.deepcopy(model).to(plan.device))
    finally:
        torch.set_float32_matmul_precision(before)
    differ = [i for i, (a, b) in enumerate(zip(on_cpu, on_device)) if a != b]
    for i in differ[:3]:
        print(f"  sentence {i}: cpu {on_cpu[i][:20]} / {plan.device.type} {on_device[i][:20]}")
    print(f"  beam 4, fp32, {len(sources)} sentences ({origin}); {len(differ)} differ")
    figures = f"{len(sources) - len(differ)}/{len(sources)} identical" + (
        "" if plan.cuda else " (cpu vs cpu: plumbing)"
    )
    # fp32 sums run in another order on the GPU: a near-tie between two hypotheses may rarely flip
    if len(differ) > 0.02 * len(sources):
        raise CheckFailed(figures)
    return figures


# ---------------------------------------------------------------- 6. which SDPA kernels run the model's attention


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
        mask = "none" if self.mask is None else "x".join(map(str, self.mask.shape)) + " bool"
        shape = lambda t: "x".join(map(str, t.shape))  # noqa: E731
        dtype = str(self.q.dtype).split(".")[1]
        return f"q {shape(self.q)}, k {shape(self.k)}, mask {mask}{', causal' if self.causal else ''}, {dtype}"


def attention_calls(model: Transformer, src: torch.Tensor, tgt_in: torch.Tensor) -> list[AttentionCall]:
    """The F.scaled_dot_product_attention calls of the model itself: a bf16 training forward (one encoder and
    one decoder layer), and the third cached decoding step in fp32 (translate, evaluate) and in bf16 (validation)."""
    seen = []
    sdpa = F.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        seen.append((q.detach(), k.detach(), v.detach(), attn_mask, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    calls = []
    with mock.patch.object(F, "scaled_dot_product_attention", record), torch.no_grad():
        with torch.autocast(src.device.type, dtype=torch.bfloat16):
            model(src, tgt_in)
        names = ["encoder self-attention", "decoder self-attention", "cross-attention"]
        calls += [AttentionCall(name, *args, backward=True) for name, args in zip(names, seen)]
        for dtype in (torch.float32, torch.bfloat16):
            seen.clear()
            with torch.autocast(src.device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                state = model.start_decoding(*model.encode(src))
                for t in range(3):
                    model.decode_step(tgt_in[:, t], state)
            names = [
                f"decoding self-attention, cache ({str(dtype)[6:]})",
                f"decoding cross-attention ({str(dtype)[6:]})",
            ]
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
            if q.is_cuda:
                torch.cuda.synchronize()
        except RuntimeError as e:  # PyTorch warns why each kernel was not used, then raises
            said = [str(w.message).split(" (Triggered internally")[0].strip().replace("\n", " ") for w in caught]
            reasons = [r for r in dict.fromkeys(said) if not r.endswith("because:")] or [str(e).replace("\n", " ")]
            return None, "; ".join(reasons)[:300]
    if call.backward and not all(torch.isfinite(t.grad).all() for t in (q, k, v)):
        return None, "non-finite gradients"
    return out.detach().float(), ""


def check_sdpa(plan: Plan) -> str:
    if not plan.cuda:
        raise Skip("needs CUDA (on the CPU the model pins SDPA's MATH backend)")
    torch.manual_seed(0)
    base = OmegaConf.to_container(OmegaConf.load(f"{CONF_DIR}/model/base.yaml"))
    cfg = TransformerConfig(vocab_size=1000, **{**base, "n_encoder_layers": 1, "n_decoder_layers": 1})
    model = Transformer(cfg).to(plan.device).eval()
    src, tgt_in, _ = token_batch(32, 30, 1000, plan.device, seed=0)
    src[::4, 20:] = PAD_ID  # more padding in some rows than token buckets leave: the mask must matter
    backends = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]
    wrong, defaults = [], {}
    print(f"  {'call':42s} {'default':10s} " + " ".join(f"{b.split('_')[0]:10s}" for b in backends))
    for call in attention_calls(model, src, tgt_in):
        reference, _ = run_attention(call, SDPBackend.MATH)
        # bf16 keeps 8 bits of mantissa: kernels that sum in another order differ by ~1% of the values' size
        tolerance = (1e-4 if call.q.dtype == torch.float32 else 2e-2) * (1 + reference.abs().max().item())
        cells, reasons = [], []
        for name in backends:
            out, why = run_attention(call, getattr(SDPBackend, name))
            if out is None:
                cells.append("no")
                reasons.append(f"{name}: {why}")
            elif (out - reference).abs().max().item() > tolerance:
                cells.append("WRONG")
                wrong.append(f"{call.name} on {name}")
            else:
                cells.append("yes")
        try:  # which backend PyTorch itself picks (a private function: report, don't fail, if it moves)
            q, k, v = (t.clone().requires_grad_(call.backward) for t in (call.q, call.k, call.v))
            choice = SDPBackend(torch._fused_sdp_choice(q, k, v, attn_mask=call.mask, is_causal=call.causal)).name
        except Exception:
            choice = "?"
        if run_attention(call, None)[0] is None:
            wrong.append(f"{call.name} with no backend chosen")
        defaults[call.name] = choice
        print(f"  {call.name:42s} {choice.split('_')[0]:10s} " + " ".join(f"{c:10s}" for c in cells))
        print(f"    {call.describe()}")
        for reason in reasons:
            print(f"    {reason}")
    counts = {}
    for choice in defaults.values():
        counts[choice.split("_")[0]] = counts.get(choice.split("_")[0], 0) + 1
    figures = f"{len(defaults)} calls; default " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    if wrong:
        raise CheckFailed(f"{figures}; wrong or failing: {', '.join(wrong)}")
    return figures


# ---------------------------------------------------------------- the run


CHECKS = [
    ("cuda tests", check_cuda_tests),
    ("training step", check_training_step),
    ("multi30k training", check_multi30k),
    ("ddp + translate", partial(check_parallel, strategy="ddp")),
    ("fsdp + translate", partial(check_parallel, strategy="fsdp")),
    ("beam gpu = cpu", check_beam),
    ("sdpa kernels", check_sdpa),
]


def run_check(number: int, name: str, check, plan: Plan) -> tuple[str, str, str, float]:
    """One check, isolated: (name, PASS/FAIL/SKIP, key figures, seconds)."""
    print(f"\n[{number}/{len(CHECKS)}] {name}", flush=True)
    start = time.perf_counter()
    try:
        status, figures = "PASS", check(plan)
    except Skip as e:
        status, figures = "SKIP", str(e)
    except CheckFailed as e:
        status, figures = "FAIL", str(e)
    except Exception as e:
        traceback.print_exc(file=sys.stdout)
        status, figures = "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
    finally:
        if plan.cuda:  # leave the GPU's memory to the next check's subprocesses (after a CUDA error this raises too)
            with contextlib.suppress(RuntimeError):
                torch.cuda.empty_cache()
    seconds = time.perf_counter() - start
    print(f"  -> {status}: {figures} ({seconds:.1f} s)", flush=True)
    return name, status, figures, seconds


def header(plan: Plan) -> str:
    versions = f"PyTorch {torch.__version__}, Lightning {lightning.__version__}, Python {platform.python_version()}"
    if not plan.cuda:
        return f"{versions}; device: CPU, {torch.get_num_threads()} torch threads; plumbing mode (tiny sizes, fp32)"
    props = torch.cuda.get_device_properties(plan.device)
    return (
        f"{versions}; CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}; device: {props.name} "
        f"(sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} visible)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: tiny sizes, a plumbing test")
    parser.add_argument(
        "--multi30k", type=Path, help="Multi30k text files (default: ../shared/data/multi30k, else the Hub)"
    )
    parser.add_argument("--updates", type=int, help="updates of check 3 (default: 200; 30 with --device cpu)")
    parser.add_argument("--steps", type=int, help="timed updates of check 2 (default: 10; 3 with --device cpu)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA GPU is visible (PyTorch {torch.__version__}), so nothing was checked; "
            "--device cpu runs the checks' code paths on the CPU with tiny sizes"
        )
        return 0
    cuda = args.device == "cuda"
    multi30k = args.multi30k or (SHARED_MULTI30K if SHARED_MULTI30K.is_dir() else None)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        plan = Plan(
            device=torch.device(args.device),
            updates=args.updates or (200 if cuda else 30),
            steps=args.steps or (10 if cuda else 3),
            multi30k=multi30k.resolve() if multi30k else None,
            workdir=Path(workdir),
        )
        print(header(plan))
        print(f"Multi30k: {plan.multi30k or 'the Hugging Face Hub (bentrevett/multi30k)'}; work folder {workdir}")
        start = time.perf_counter()
        results = [run_check(i, name, check, plan) for i, (name, check) in enumerate(CHECKS, 1)]
    width = max(len(figures) for _, _, figures, _ in results)
    print(f"\n{'check':18s}  {'result':6s}  {'key figures':{width}s}  seconds")
    for name, status, figures, seconds in results:
        print(f"{name:18s}  {status:6s}  {figures:{width}s}  {seconds:7.1f}")
    statuses = [status for _, status, _, _ in results]
    print(
        f"\ngpu-check: {statuses.count('PASS')} passed, {statuses.count('FAIL')} failed, "
        f"{statuses.count('SKIP')} skipped in {time.perf_counter() - start:.0f} s"
    )
    return 1 if "FAIL" in statuses else 0


if __name__ == "__main__":
    sys.exit(main())
