"""The end of a run (§6.1): average the last N periodic checkpoints, decode and score each of final.splits, write
results.json and a block in the log; the end of training and make finish build it alike (Protocol.of_run)."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

from transformer_mt.checkpoint import (
    average_checkpoints,
    ema_state,
    load_for_inference,
    read_checkpoint,
    run_checkpoints,
    write_checkpoint,
)
from transformer_mt.data.batching import TokenBucketSampler, collate
from transformer_mt.data.corpus import Corpus
from transformer_mt.decoding import Decoding
from transformer_mt.errors import MissingInputError
from transformer_mt.files import RunFolder, shown
from transformer_mt.model import Transformer
from transformer_mt.objective import sequence_losses
from transformer_mt.results import Results
from transformer_mt.runtime import Peak, use_tf32
from transformer_mt.scoring import evaluate_translations
from transformer_mt.search import translate_lines
from transformer_mt.tokenizer import Tokenizer

log = logging.getLogger(__name__)
PERPLEXITY_TOKENS = 4096  # a teacher-forced batch's padded tokens per side


@dataclass
class Protocol:
    run: RunFolder
    decoding: Decoding
    corpus: Corpus
    splits: list[str]
    average_last: int
    label_smoothing: float
    ema: bool
    extra: dict  # Results' table3_row, seed, code, overrides, finished_by
    devices: int  # how many devices trained (the MFU is per device)
    texts: dict[str, tuple[list[str], list[str]]] = field(default_factory=dict, repr=False)  # read once

    @classmethod
    def of_run(cls, run: RunFolder, cfg: Mapping, **changes) -> Protocol:
        final, devices = cfg["final"], cfg["trainer"]["devices"]
        settings = dict(
            run=run,
            decoding=Decoding.of(cfg["decoding"], where=f"{run.last} (its config)"),
            corpus=Corpus.from_config(cfg["data"]),
            splits=list(final["splits"]),
            average_last=final["average_last"],
            label_smoothing=cfg["label_smoothing"],
            ema=bool(cfg["ema_decay"]),
            extra={"table3_row": cfg["table3_row"], "seed": cfg["seed"], "code": cfg.get("code")},
            devices=devices * cfg["trainer"]["num_nodes"] if isinstance(devices, int) else 1,  # "auto": 1
        )
        return cls(**{**settings, **changes})

    def plan(self) -> str:
        """What the end of the run will do, and how to skip it: said as the run starts."""
        average = f"average the last {self.average_last} periodic checkpoints, " if self.average_last else ""
        splits, them = " and ".join(self.splits), "them" if len(self.splits) > 1 else "it"
        return (
            f"when training ends (final.enabled): {average}decode {splits} at {self.decoding.text()} and score "
            f"{them}; final.enabled=false skips it (make finish RUN={shown(self.run.path)} does it later)"
        )

    def split(self, name: str) -> tuple[list[str], list[str]]:
        if name not in self.texts:
            self.texts[name] = self.corpus.texts(name)
        return self.texts[name]

    def run_on(self, device: torch.device, peak: Peak | None = None) -> Results:
        """peak: one training device's, for the MFU."""
        start = time.monotonic()
        log.info(
            f"the end of the run (§6.1): averaging, decoding and scoring {', '.join(self.splits)}; if this is "
            f"interrupted, finish it with: make finish RUN={self.run.path}"
        )
        chosen = self.checkpoints()
        results = self.training_figures(peak)
        if device.type == "cuda":
            use_tf32()  # fp32 decoding on tensor cores, as make evaluate (checkpoint.start_inference)
        for name, path in chosen.items():
            model, tokenizer, _ = load_for_inference(path)
            model.to(device)
            results.parameters = sum(p.numel() for p in model.parameters())
            results.models[name] = {"checkpoint": str(path)}
            for split in self.splits:
                scores = self.scores(model, tokenizer, split, self.decoding) | self.perplexity(model, tokenizer, split)
                results.models[name][split] = scores
                log.info(
                    f"{name} on {split}: {scores['sentences']:,} sentences decoded ({self.decoding.text()}) and scored "
                    f"in {scores['seconds']:.1f} s: sacreBLEU {scores['bleu']:.2f}"
                )
        results.evaluation_seconds = round(time.monotonic() - start, 1)
        self.run.keep_earlier_results()
        results.write(self.run.results)
        log.info("%s", results.block(self.run.results))
        return results

    def checkpoints(self) -> dict[str, Path]:
        """By name: average-last<N>.ckpt, written now (else last.ckpt), and with `ema` ema.ckpt."""
        chosen, periodic = {}, []
        if self.average_last:
            with contextlib.suppress(MissingInputError):  # the run kept none
                periodic = run_checkpoints(self.run.checkpoints)[-self.average_last :]
            if len(periodic) < self.average_last:
                then = "averaging those" if periodic else "evaluating last.ckpt"
                log.warning(f"final.average_last={self.average_last}: {len(periodic)} periodic checkpoints, {then}")
        if periodic:
            path = self.run.checkpoints / RunFolder.average_name(len(periodic))
            write_checkpoint(average_checkpoints(periodic), path)
            log.info("averaged %s -> %s", ", ".join(p.name for p in periodic), path.name)
            chosen[path.stem] = path
        else:
            chosen["last"] = self.run.last
        if self.ema:
            checkpoint = read_checkpoint(self.run.last)
            keep = ("hyper_parameters", "sentencepiece", "global_step", "epoch")
            write_checkpoint({**{k: checkpoint[k] for k in keep}, "state_dict": ema_state(checkpoint)}, self.run.ema)
            chosen["ema"] = self.run.ema
        return chosen

    def training_figures(self, peak: Peak | None) -> Results:
        last = read_checkpoint(self.run.last, mmap=True, finite=False)
        seconds, tokens, flops = (last["totals"][k] for k in ("train_seconds", "target_tokens", "model_flops"))
        flops_per_second = flops / seconds if flops and seconds else None
        mfu = peak.utilisation(flops_per_second / self.devices) if peak and flops_per_second else None
        significant = lambda x: float(f"{x:.4g}") if x else None  # noqa: E731
        return Results(
            updates=last["global_step"],
            train_seconds=round(seconds, 1),
            target_tokens=tokens,
            target_tokens_per_second=round(tokens / seconds) if seconds else None,
            model_flops_per_second=significant(flops_per_second),
            devices=self.devices,
            mfu=significant(mfu),
            peak=peak.source if peak and peak.flops else None,  # None: no peak known (a CPU)
            peak_flops_per_second=significant(peak and peak.flops),
            decoding=self.decoding.settings(),
            **self.extra,
        )

    def scores(self, model: Transformer, tokenizer: Tokenizer, split: str, decoding: Decoding) -> dict:
        report = partial(log.info, "decoding %s (%s): %s", split, decoding.text())  # once a minute, a long decode
        translate = partial(translate_lines, model, tokenizer, report=report, **decoding.settings())
        return evaluate_translations(translate, *self.split(split), self.corpus.tgt_lang)[2]

    @torch.no_grad()
    def perplexity(self, model: Transformer, tokenizer: Tokenizer, split: str) -> dict:
        """Teacher-forced loss and perplexity per target token (EOS included)."""
        sources, targets = (tokenizer.encode(side) for side in self.split(split))
        device = next(model.parameters()).device
        lengths = [np.array([len(ids) for ids in side]) for side in (sources, targets)]
        batches = TokenBucketSampler(*lengths, max_tokens=PERPLEXITY_TOKENS, shuffle=False)
        sums = torch.zeros(3, dtype=torch.float64)
        for indices in batches:
            batch = collate([(sources[i], targets[i], i) for i in indices])
            tensors = (batch[key].to(device) for key in ("src", "tgt_in", "tgt_out"))
            losses = sequence_losses(model, *tensors, self.label_smoothing)
            sums += torch.stack([value.double() for value in losses]).cpu()
        loss_sum, nll_sum, tokens = sums.tolist()
        return {"loss": round(loss_sum / tokens, 4), "ppl": round(math.exp(nll_sum / tokens), 3)}
