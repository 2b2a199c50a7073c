"""The paper's protocol when a run ends (§6.1): average the last N periodic checkpoints (5 for base, 20 for
big), decode the test split with beam search (beam 4, alpha 0.6), score it. Writes <run>/results.json and
a block in the run's log: sacreBLEU with its signature, chrF, the tokenized compound-split BLEU the paper
reports, perplexity, the update count, training time and target tokens/s.

conf/train.yaml's `final` block sets it; `make average` and `make evaluate` do the same steps by hand.
"""

from __future__ import annotations

import json
import logging
import math
import time
from functools import partial
from pathlib import Path

import torch

from transformer_mt.checkpoint import (
    average_checkpoints,
    load_for_inference,
    read_checkpoint,
    run_checkpoints,
    write_checkpoint,
)
from transformer_mt.errors import MissingInputError
from transformer_mt.files import RESULTS, atomic_write
from transformer_mt.model import Transformer
from transformer_mt.objective import sequence_losses
from transformer_mt.runtime import Peak, duration, flops_text, use_tf32
from transformer_mt.scoring import evaluate_translations
from transformer_mt.search import translate_lines
from transformer_mt.tokenizer import Tokenizer
from transformer_mt.tuning import TABLE_HEADER, save_tuned, search_grid, table_row

log = logging.getLogger(__name__)


def final_checkpoints(checkpoint_dir: Path, average_last: int, ema: bool) -> dict[str, Path]:
    """What the protocol evaluates, by name: the average of the last `average_last` periodic checkpoints
    (written as average-last<N>.ckpt), or last.ckpt when averaging is off or there is nothing to average;
    with `ema`, also the exponential moving average of the weights (ema.ckpt)."""
    last = checkpoint_dir / "last.ckpt"
    chosen = {}
    periodic = []
    if average_last:
        try:
            periodic = run_checkpoints(checkpoint_dir)[-average_last:]
        except MissingInputError:
            log.warning(
                "final.average_last=%d: the run kept no periodic checkpoints; evaluating last.ckpt", average_last
            )
    if periodic:
        if len(periodic) < average_last:
            log.warning(
                "final.average_last=%d: only %d periodic checkpoints, averaging those", average_last, len(periodic)
            )
        path = checkpoint_dir / f"average-last{len(periodic)}.ckpt"
        write_checkpoint(average_checkpoints(periodic), path)
        log.info("averaged %s -> %s", ", ".join(p.name for p in periodic), path.name)
        chosen[f"average-last{len(periodic)}"] = path
    else:
        chosen["last"] = last
    if ema:
        try:
            chosen["ema"] = write_ema_checkpoint(last, checkpoint_dir / "ema.ckpt")
        except KeyError as e:
            log.warning("ema_decay is set but %s holds no moving average (%s): not evaluated", last.name, e.args[0])
    return chosen


def write_ema_checkpoint(last: Path, path: Path) -> Path:
    """last.ckpt with its weights replaced by the moving average it carries (training/ema.py)."""
    from transformer_mt.training.ema import ema_state  # noqa: PLC0415 (ema imports Lightning callbacks)

    checkpoint = read_checkpoint(last)
    state = ema_state(checkpoint)
    keep = {k: checkpoint[k] for k in ("hyper_parameters", "sentencepiece", "global_step", "epoch") if k in checkpoint}
    write_checkpoint({**keep, "state_dict": state}, path)
    return path


def evaluate_split(
    model: Transformer, tokenizer: Tokenizer, datamodule, split: str, decoding: dict, label_smoothing: float
) -> dict:
    """A split scored as `make evaluate` scores it (scoring.evaluate_translations: its source lines through
    search.translate_lines), and its teacher-forced loss and perplexity."""
    scores = translation_scores(model, tokenizer, datamodule, split, decoding)
    return {**scores, **perplexity(model, datamodule.whole_split_loader(split), label_smoothing)}


def translation_scores(model: Transformer, tokenizer: Tokenizer, datamodule, split: str, decoding: dict) -> dict:
    """evaluate_split's translation scores alone (the perplexity does not depend on the decoding settings)."""
    texts = datamodule.splits[split].texts
    translate = partial(translate_lines, model, tokenizer, **decoding)
    *_, scores = evaluate_translations(translate, texts("src_text"), texts("tgt_text"), datamodule.corpus.tgt_lang)
    return scores


def tune_and_score(
    model: Transformer, tokenizer: Tokenizer, datamodule, path: Path, final: dict, decoding: dict
) -> dict:
    """final.tune: make tune's grid on the validation split (tuning.py; never the test split), the choice stored
    beside the checkpoint (so that make translate / make evaluate use it), then final.splits at that choice."""
    texts = datamodule.splits["validation"].texts
    log.info("choosing beam and length penalty on the validation split for %s (final.tune):", path.name)
    log.info("%s", TABLE_HEADER)
    start = time.monotonic()
    chosen, rows = search_grid(
        partial(translate_lines, model, tokenizer), texts("src_text"), texts("tgt_text"), datamodule.corpus.tgt_lang,
        decoding, final["tune_alphas"], final["tune_beams"], report=lambda row: log.info("%s", table_row(row)),
        alphas_at_once=True, say=lambda line: log.info("%s", line),
    )  # fmt: skip
    save_tuned(path, chosen, rows, f"{datamodule.corpus.name} validation")
    scores = {split: translation_scores(model, tokenizer, datamodule, split, chosen) for split in final["splits"]}
    return {"decoding": chosen, "chosen_on": "validation", "tune_seconds": round(time.monotonic() - start, 1), **scores}


@torch.no_grad()
def perplexity(model: Transformer, loader, label_smoothing: float) -> dict:
    """Teacher-forced loss and perplexity per target token (EOS included) over every batch of a split."""
    device = next(model.parameters()).device
    sums = torch.zeros(3, dtype=torch.float64)
    for batch in loader:
        tensors = (batch[key].to(device) for key in ("src", "tgt_in", "tgt_out"))
        sums += torch.stack([value.double() for value in sequence_losses(model, *tensors, label_smoothing)]).cpu()
    loss_sum, nll_sum, tokens = sums.tolist()
    return {"loss": round(loss_sum / tokens, 4), "ppl": round(math.exp(nll_sum / tokens), 3)}


def finish_run(
    run_dir: Path,
    final: dict,
    decoding: dict,
    datamodule,
    device: torch.device,
    label_smoothing: float,
    ema: bool,
    extra: dict | None = None,
    peak: Peak | None = None,
    devices: int = 1,
) -> dict:
    """The protocol on a finished run (one process): results.json in run_dir, a block in the log. peak: one
    training device's (for the MFU), devices: how many trained."""
    start = time.monotonic()
    log.info("the end of the run (§6.1): averaging, decoding and scoring %s; if this is interrupted, finish it "
             "with: make finish RUN=%s", ", ".join(final["splits"]), run_dir)  # fmt: skip
    checkpoint_dir = run_dir / "checkpoints"
    chosen = final_checkpoints(checkpoint_dir, final["average_last"], ema)
    last = read_checkpoint(checkpoint_dir / "last.ckpt", mmap=True, finite=False)
    totals = last.get("totals", {})
    seconds, tokens = totals.get("train_seconds", 0.0), totals.get("target_tokens", 0)
    flops = totals.get("model_flops")  # absent from checkpoints written before it was counted
    flops_per_second = flops / seconds if flops and seconds else None
    mfu = peak.utilisation(flops_per_second / devices) if peak and flops_per_second else None
    results = {
        "updates": last.get("global_step"),
        "train_seconds": round(seconds, 1),
        "target_tokens": tokens,
        "target_tokens_per_second": round(tokens / seconds) if seconds else None,
        "model_flops_per_second": float(f"{flops_per_second:.4g}") if flops_per_second else None,
        "devices": devices,
        "mfu": float(f"{mfu:.4g}") if mfu else None,
        "peak": peak.source if peak else None,
        "peak_flops_per_second": float(f"{peak.flops:.4g}") if peak and peak.flops else None,
        "parameters": None,
        "decoding": decoding,
        **(extra or {}),
        "models": {},
    }
    if device.type == "cuda":
        use_tf32()  # fp32 decoding on tensor cores, as make evaluate (checkpoint.start_inference)
    for name, path in chosen.items():
        model, tokenizer, _ = load_for_inference(path)
        model.to(device)
        results["parameters"] = sum(p.numel() for p in model.parameters())
        results["models"][name] = {"checkpoint": str(path)}
        for split in final["splits"]:
            scores = evaluate_split(model, tokenizer, datamodule, split, decoding, label_smoothing)
            results["models"][name][split] = scores
            log.info("%s on %s: %s sentences decoded (beam %s, alpha %s) and scored in %.1f s: sacreBLEU %.2f",
                     name, split, f"{scores['sentences']:,}", decoding.get("beam_size"), decoding.get("alpha"),
                     scores["seconds"], scores["bleu"])  # fmt: skip
        if final.get("tune"):
            results.setdefault("tuned", {})[name] = tune_and_score(model, tokenizer, datamodule, path, final, decoding)
    results["evaluation_seconds"] = round(time.monotonic() - start, 1)
    if results["evaluation_seconds"] > seconds:
        log.warning(
            "the end of the run took %s, longer than its %s of training%s",
            duration(results["evaluation_seconds"]), duration(seconds),
            ": final.tune's grid decodes the validation split up to 9 times (final.tune=false, or fewer "
            "final.tune_alphas / final.tune_beams, shortens it)" if final.get("tune") else "",
        )  # fmt: skip
    keep_earlier_results(run_dir / RESULTS)
    with atomic_write(run_dir / RESULTS) as tmp:
        tmp.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    log.info("%s", results_block(results, run_dir / RESULTS))
    return results


def keep_earlier_results(path: Path) -> Path | None:
    """An earlier results.json of the run (make finish on a finished run, a run extended and finished again) is
    kept beside the new one as results.<n>.json, the first free n, and the log says so: nothing is overwritten."""
    if not path.is_file():
        return None
    n = 1
    while (kept := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    path.rename(kept)
    log.warning("%s was there already (an earlier end of this run): kept as %s, beside the new one", path, kept.name)
    return kept


def final_metrics(results: dict) -> dict[str, float]:
    """results.json's scores as logger metrics: final/<model>/<split>/<bleu|chrf|tokenized_bleu|ppl> (a tuned
    split has no ppl of its own: the teacher-forced loss does not depend on the decoding settings)."""
    names = {"bleu": "bleu", "chrf": "chrf", "tokenized_bleu_compound_split": "tokenized_bleu", "ppl": "ppl"}
    scored = [(model, split, scores) for model, splits in results["models"].items() for split, scores in splits.items()]
    scored += [(f"{model}/tuned", split, scores) for model, tuned in results.get("tuned", {}).items()
               for split, scores in tuned.items()]  # fmt: skip
    return {
        f"final/{model}/{split}/{short}": scores[key]
        for model, split, scores in scored
        if isinstance(scores, dict) and "bleu" in scores
        for key, short in names.items()
        if key in scores
    }


def results_block(results: dict, path: Path) -> str:
    """The log's summary of results.json: one line per evaluated model and split."""
    rate, flops, mfu = (results.get(key) for key in ("target_tokens_per_second", "model_flops_per_second", "mfu"))
    lines = [
        f"results ({path}): {results['updates']:,} updates, {duration(results['train_seconds'])} of training"
        + (f", {rate:,} target tok/s" if rate else "")
        + (f", {flops_text(flops)}" if flops else "")
        + (f" (MFU {mfu:.1%})" if mfu else "")
        + f", {results['parameters']:,} parameters; "
        + f"beam {results['decoding'].get('beam_size')}, alpha {results['decoding'].get('alpha')}"
    ]
    for name, model in results["models"].items():
        for split, s in model.items():
            if split == "checkpoint":
                continue
            lines.append(
                f"  {name} on {split} ({s['sentences']:,} sentences): sacreBLEU {s['bleu']:.2f}, chrF {s['chrf']:.2f}, "
                f"tokenized compound-split BLEU {s['tokenized_bleu_compound_split']:.2f} (the paper's metric), "
                f"ppl {s['ppl']:.2f}"
            )
            lines.append(f"    {s['bleu_signature']}")
    for name, tuned in results.get("tuned", {}).items():
        chosen = tuned["decoding"]
        for split, s in tuned.items():
            if isinstance(s, dict) and "bleu" in s:
                paper = results["models"][name][split]["bleu"]
                lines.append(
                    f"  {name} on {split} at the settings chosen on the validation split (beam {chosen['beam_size']}, "
                    f"alpha {chosen['alpha']}, max length {chosen['max_len_a']:g} x source + {chosen['max_len_b']}): "
                    f"sacreBLEU {s['bleu']:.2f} ({s['bleu'] - paper:+.2f} over the paper's), chrF {s['chrf']:.2f}"
                )
    return "\n".join(lines)
