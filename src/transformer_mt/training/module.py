"""The LightningModule: trains with objective.py's loss and Noam schedule (Adam, §5.3); validation loss,
greedy BLEU and chrF; test-split beam search."""

from __future__ import annotations

import logging
import math
import time

import lightning as L
import torch
from torch import Tensor

from transformer_mt.errors import UserError
from transformer_mt.model import Transformer, TransformerConfig, training_flops
from transformer_mt.objective import noam_lr, sequence_losses
from transformer_mt.scoring import corpus_scores
from transformer_mt.search import beam_search, greedy
from transformer_mt.tokenizer import Tokenizer
from transformer_mt.training.sharding import full_copy, is_sharded

log = logging.getLogger(__name__)


class TrainingDiverged(UserError):
    """A non-finite loss or gradient: the run stops with one line instead of training on NaN."""


class TranslationModule(L.LightningModule):
    """Trains a Transformer; validation and test score translations of their own batches.

    Everything it needs comes in through the constructor: the tokenizer decodes hypotheses
    (and travels inside every checkpoint), batches of validation/test carry their references.
    """

    def __init__(
        self,
        model: dict,
        label_smoothing: float = 0.1,
        lr_factor: float = 1.0,
        warmup_steps: int = 4000,
        betas: tuple[float, float] = (0.9, 0.98),
        eps: float = 1e-9,
        val_bleu_sentences: int = 500,
        decoding: dict | None = None,  # beam search for test_step (conf/decoding)
        config: dict | None = None,  # the run's resolved config, kept in checkpoints for reference
        tokenizer: Tokenizer | None = None,  # None when restored from a checkpoint: it carries its own
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["tokenizer"])  # plain values only: no nn.Module, no DictConfig
        self.model = Transformer(TransformerConfig(**model))
        self.tokenizer = tokenizer
        self._sums = torch.zeros(3)  # smoothed loss, NLL, target tokens
        self._hyps: dict[int, tuple[list[int], str]] = {}  # index in the split -> (hypothesis ids, reference)
        self._last_batch_end: float | None = None
        self._update = [0, 0.0]  # target tokens and model FLOPs of the update being accumulated, this rank (host)
        self.signal_received = 0  # a stop signal's number, noted by RunEnd; decided on at the update's one sync
        self.update_signal = 0  # ... the largest over the ranks, known from the update's one sync
        self._decoder: Transformer | None = None  # what validation and test decode with (sharding.py)
        self._training_losses = sequence_losses  # compiled by compile_training (trainer.compile)
        self._compile_clock: float | None = None  # when the first compiled micro-batch started; 0.0: logged
        # Training's target tokens and model FLOPs (every rank's) and seconds over every attempt of the run, kept
        # in checkpoints for results.json's tokens/s and MFU. Several ranks' sums stay on the device until a
        # checkpoint is written: no sync of their own.
        self.totals = {"target_tokens": 0, "model_flops": 0.0, "train_seconds": 0.0}
        self._new_totals: Tensor | None = None
        self._clock: float | None = None

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        return self.model(src, tgt_in)

    def compile_training(self) -> None:
        """trainer.compile: the training step's forward and loss (sequence_losses) through torch.compile, with
        dynamic shapes (token buckets vary the batch's sentences and lengths); the backward follows it
        (AOTAutograd). Validation's and the test's decoding go through Transformer.compile_decoding. The model
        itself is not wrapped: its parameters and checkpoint keys stay eager's (no `_orig_mod.`); validation
        and test losses run eager."""
        self._training_losses = torch.compile(sequence_losses, dynamic=True)
        self.model.compile_decoding()

    def _losses(self, batch: dict[str, Tensor], losses=sequence_losses) -> tuple[Tensor, Tensor, Tensor]:
        src, tgt_in, tgt_out = batch["src"], batch["tgt_in"], batch["tgt_out"]
        return losses(self.model, src, tgt_in, tgt_out, self.hparams.label_smoothing, batch.get("target_positions"))

    # -- training

    def on_train_start(self) -> None:
        self._clock = time.monotonic()

    def training_totals(self) -> dict:
        """self.totals brought up to now: the tokens and FLOPs of the updates since the last call, and the time."""
        if self._new_totals is not None:
            tokens, flops = self._new_totals.tolist()
            self.totals["target_tokens"] += int(tokens)
            self.totals["model_flops"] += flops
            self._new_totals = None
        if self._clock is not None:
            now = time.monotonic()
            self.totals["train_seconds"] += now - self._clock
            self._clock = now
        return dict(self.totals)

    # No step below waits for the device, but one per update (the gradient norm's finiteness, and the stop
    # decision with it): the counts come from collate, on the host (tests/test_module.py guards this).

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        if self._training_losses is not sequence_losses and self._compile_clock is None:
            self._compile_clock = time.perf_counter()  # the first compiled micro-batch starts
        loss_sum, nll_sum, n_tokens = self._losses(batch, self._training_losses)
        self.log("train/loss", loss_sum / n_tokens, prog_bar=True)  # per target token of this micro-batch
        self.log("train/nll", nll_sum / n_tokens)
        self.log("train/ppl", torch.exp(nll_sum / n_tokens))
        tokens = sum(batch["tgt_lengths"])  # = n_tokens, known on the host
        flops = training_flops(self.model.cfg, batch["src_lengths"], batch["tgt_lengths"])
        self._update = [self._update[0] + tokens, self._update[1] + flops]
        # The sum, not the mean: every target token of an update weighs the same, whichever micro-batch
        # or rank it is in (as fairseq). on_before_optimizer_step divides by the update's tokens.
        return {"loss": loss_sum, "loss_sum": loss_sum.detach(), "tokens": tokens, "flops": flops}

    def on_train_batch_end(self, outputs, batch: dict[str, Tensor], batch_idx: int) -> None:
        now = time.perf_counter()
        if self._compile_clock and self.trainer.is_global_zero:  # forward and backward compiled by now
            log.info("trainer.compile: the first training micro-batch took %.1f s, compilation included",
                     now - self._compile_clock)  # fmt: skip
        if self._compile_clock:
            self._compile_clock = 0.0
        if self._last_batch_end is not None:  # data loading + step time of this batch
            seconds = now - self._last_batch_end
            self.log("train/src_tok_per_s", sum(batch["src_lengths"]) / seconds)
            self.log("train/tgt_tok_per_s", sum(batch["tgt_lengths"]) / seconds, prog_bar=True)
        self._last_batch_end = now

    def on_before_optimizer_step(self, optimizer) -> None:
        signal_flag = self._normalise_gradients()
        grad_norm = gradient_norm(self.parameters(), is_sharded(self.trainer.strategy))
        self.log("train/grad_norm", grad_norm)
        # The update's one sync: the norm, and with several ranks whether any received a stop signal (RunEnd).
        if signal_flag is None:
            norm, self.update_signal = grad_norm.item(), self.signal_received
        else:
            norm, received = torch.stack([grad_norm.float(), signal_flag.float()]).tolist()
            self.update_signal = int(received)
        # Stop before a non-finite gradient reaches the weights, so no checkpoint ever holds NaN or inf.
        # (fp16's loss scaler skips such steps itself; one check per update, not per micro-batch.)
        if self.trainer.precision != "16-mixed" and not math.isfinite(norm):
            raise TrainingDiverged(
                f"training diverged at update {self.global_step + 1}: the gradient norm is {norm}. "
                "Likely causes: a learning rate too high (optim.lr_factor, optim.warmup_steps), fp16 overflow "
                "(use trainer.precision=bf16-mixed or 32-true), or corrupt data. The weights were not updated; "
                "the checkpoints written so far are finite"
            )

    def _normalise_gradients(self) -> Tensor | None:
        """Gradient of the update's summed loss / its target tokens over every micro-batch and rank.
        Lightning divided each micro-batch's loss by the accumulation factor and DDP/FSDP average the
        ranks' gradients: undo both, then divide by the tokens. With several ranks, one all-reduce sums
        the tokens and FLOPs and another finds the largest stop signal any rank noted (both stay on the
        device); returned for the update's one sync."""
        (tokens, flops), self._update = self._update, [0, 0.0]
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if self.trainer.world_size == 1:  # all on the host
            self.totals["target_tokens"] += tokens
            self.totals["model_flops"] += flops
            torch._foreach_mul_(grads, self.trainer.accumulate_grad_batches / tokens)
            return None
        # float64: exact far past float32's 2^24 tokens between checkpoints
        sums = torch.tensor([tokens, flops], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(sums)
        self._new_totals = sums if self._new_totals is None else self._new_totals + sums
        scale = (self.trainer.accumulate_grad_batches * self.trainer.world_size / sums[0]).float()
        torch._foreach_mul_(grads, scale)  # on the gradients' device
        signal_flag = torch.tensor([self.signal_received], device=self.device)
        torch.distributed.all_reduce(signal_flag, op=torch.distributed.ReduceOp.MAX)
        return signal_flag[0]

    def configure_optimizers(self):
        h = self.hparams
        # fused: one kernel for all parameters (CPU and CUDA), measurably faster than the loop
        optimizer = torch.optim.Adam(self.parameters(), lr=1.0, betas=tuple(h.betas), eps=h.eps, fused=True)
        d_model = self.model.cfg.d_model
        # LambdaLR calls this with the number of updates done so far; update n (from 1) uses noam(n).
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda done: noam_lr(done + 1, d_model, h.warmup_steps, h.lr_factor)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step", "frequency": 1}}

    # -- validation: loss on every batch, greedy BLEU/chrF on the first val_bleu_sentences sentences

    def on_validation_epoch_start(self) -> None:
        self._sums = torch.zeros(3, device=self.device)
        self._hyps = {}
        # Under FSDP a plain copy of the whole model, gathered here on every rank alike: decoding through
        # the sharded layers would issue a rank-dependent number of collectives and hang.
        sharded = is_sharded(self.trainer.strategy) and self.trainer.world_size > 1
        self._decoder = full_copy(self.trainer.model, self.model) if sharded else self.model

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._add_losses(batch)
        if self.hparams.val_bleu_sentences and not self.trainer.sanity_checking:
            rows = batch["index"] < self.hparams.val_bleu_sentences
            if rows.any():
                self._keep_hypotheses(batch, rows, greedy(self._decoder, batch["src"][rows]))

    def on_validation_epoch_end(self) -> None:
        self._decoder = None
        loss, nll = self._mean_losses()
        if loss is None:
            raise RuntimeError("validation saw no target tokens: the validation loader yielded no batch")
        metrics = {"val/loss": loss, "val/nll": nll, "val/ppl": torch.exp(nll)}
        summary = f"validation at update {self.global_step}: loss {loss:.3f}, ppl {torch.exp(nll):.2f}"
        if self.hparams.val_bleu_sentences and not self.trainer.sanity_checking:
            scores = self._score_hypotheses()
            metrics.update({f"val/{name}": value for name, value in scores.items()})
            summary += (
                f", greedy sacreBLEU {scores['bleu']:.2f}, chrF {scores['chrf']:.2f} ({len(self._hyps)} sentences)"
            )
        # Every rank holds the same values (sums reduced, hypotheses gathered): checkpoint monitors agree.
        self.log_dict(
            {k: metrics.pop(k) for k in ("val/loss", "val/bleu") if k in metrics}, prog_bar=True, sync_dist=True
        )
        self.log_dict(metrics, sync_dist=True)
        if self.trainer.is_global_zero and not self.trainer.sanity_checking:
            log.info(summary)  # the learning curve in the run's log, whatever the logger

    def on_validation_end(self) -> None:
        # After every callback's on_validation_end (Lightning calls the module's last): the checkpoints that
        # waited for this validation are written now, holding best.ckpt's score of this validation.
        for callback in self.trainer.callbacks:
            if hasattr(callback, "after_validation"):
                callback.after_validation(self.trainer, self)

    # -- test: beam search on the whole test split

    def on_test_epoch_start(self) -> None:
        self.on_validation_epoch_start()

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._add_losses(batch)
        hyps, _ = beam_search(self._decoder, batch["src"], **decoding_options(self.hparams.decoding))
        self._keep_hypotheses(batch, torch.ones_like(batch["index"], dtype=torch.bool), hyps)

    def on_test_epoch_end(self) -> None:
        self._decoder = None
        loss, nll = self._mean_losses()
        metrics = {"test/loss": loss, "test/ppl": torch.exp(nll)}
        metrics.update({f"test/{name}": value for name, value in self._score_hypotheses().items()})
        self.log_dict(metrics, sync_dist=True)

    # -- shared by validation and test

    def _add_losses(self, batch: dict) -> None:
        loss_sum, nll_sum, n_tokens = self._losses(batch)
        self._sums += torch.stack([loss_sum, nll_sum, n_tokens.to(loss_sum.dtype)]).detach()

    def _mean_losses(self) -> tuple[Tensor | None, Tensor | None]:
        loss_sum, nll_sum, n_tokens = self.trainer.strategy.reduce(self._sums, reduce_op="sum")
        return (None, None) if n_tokens == 0 else (loss_sum / n_tokens, nll_sum / n_tokens)

    def _keep_hypotheses(self, batch: dict, rows: Tensor, hyps: list[list[int]]) -> None:
        references = [ref for ref, keep in zip(batch["reference"], rows.tolist()) if keep]
        self._hyps.update(zip(batch["index"][rows].tolist(), zip(hyps, references)))

    def _score_hypotheses(self) -> dict[str, float]:
        """Corpus scores of the hypotheses of every rank, detokenized, in split order."""
        hyps = self._hyps
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            shards = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(shards, hyps)
            hyps = {i: h for shard in shards for i, h in shard.items()}
        self._hyps = hyps
        order = sorted(hyps)
        texts = self.tokenizer.decode([hyps[i][0] for i in order])
        return corpus_scores(texts, [hyps[i][1] for i in order])

    # -- checkpoints: the SentencePiece model travels inside every one, so the file alone can translate

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # The metrics logged so far reach the disk with every checkpoint: a killed run loses no CSV row
        # before its newest checkpoint, and the run resumed from it writes the rows after it.
        for logger in self.trainer.loggers:
            logger.save()
        if self.tokenizer is not None:
            checkpoint["sentencepiece"] = self.tokenizer.proto
        checkpoint["totals"] = self.training_totals()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.totals = {**self.totals, **checkpoint.get("totals", {})}  # older checkpoints lack model_flops
        if self.tokenizer is None and "sentencepiece" in checkpoint:
            self.tokenizer = Tokenizer(proto=checkpoint["sentencepiece"], origin="checkpoint (sentencepiece)")


BATCHING_KEYS = {"max_tokens", "tokens_per_batch"}  # in conf/decoding of older checkpoints; test batches are given


def decoding_options(decoding: dict | None) -> dict:
    """conf/decoding as beam_search's arguments (its defaults are §6.1's), without the batching keys that
    checkpoints written before they moved to conf/inference.yaml carry in their hyper-parameters."""
    return {k: v for k, v in (decoding or {}).items() if k not in BATCHING_KEYS}


def gradient_norm(parameters, sharded: bool) -> Tensor:
    """The L2 norm of the whole gradient. Sharded (FSDP), each rank holds a part of it: the squares are
    summed across ranks, so that every rank logs and decides on the same norm (a NaN in one shard
    stops every rank alike, instead of one rank while the others wait). DDP's gradients are already
    the same on every rank."""
    grads = [p.grad.detach() for p in parameters if p.grad is not None and p.grad.numel()]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else torch.zeros(())  # one fused kernel
    if sharded and torch.distributed.is_available() and torch.distributed.is_initialized():
        squares = norm.float().square()
        torch.distributed.all_reduce(squares)
        return squares.sqrt()
    return norm.float()
