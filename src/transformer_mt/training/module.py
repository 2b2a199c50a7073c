"""The LightningModule: the loss, Adam with Noam's schedule (§5.3) or a time budget's, validation's BLEU and chrF."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict

import lightning as L
import torch
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor

from transformer_mt.model import Transformer, TransformerConfig
from transformer_mt.objective import noam_lr, sequence_losses
from transformer_mt.runtime import compile_decoding, sentence_attention
from transformer_mt.scoring import corpus_scores
from transformer_mt.search import greedy
from transformer_mt.stops import epoch_ends
from transformer_mt.tokenizer import Tokenizer
from transformer_mt.training.budget import TimeBudget
from transformer_mt.training.sharding import LayerFSDP, full_copy
from transformer_mt.training.update import UpdateBookkeeping, gradient_norm, log_metrics

log = logging.getLogger(__name__)


class TranslationModule(L.LightningModule):
    """Trains a Transformer; validation scores greedy translations; the tokenizer travels in every checkpoint."""

    def __init__(
        self,
        model: dict,
        label_smoothing: float = 0.1,
        lr_factor: float = 1.0,
        warmup_steps: int = 4000,
        betas: tuple[float, float] = (0.9, 0.98),
        eps: float = 1e-9,
        val_bleu_sentences: int = 500,
        budget: dict | None = None,  # a time budget's settings (TimeBudget's fields); None: Noam's schedule
        config: dict | None = None,  # the run's resolved config, kept in checkpoints for reference
        tokenizer: Tokenizer | None = None,  # None: no validation BLEU (val_bleu_sentences=0), none in checkpoints
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["tokenizer"])  # plain values only: no nn.Module, no DictConfig
        self.automatic_optimization = False  # the update is written out below (update)
        self.accumulation = 1  # micro-batches per update: batch_fit.shape_updates sets it from data.tokens_per_update
        self.model = Transformer(TransformerConfig(**model))
        self.tokenizer = tokenizer
        self.updates = UpdateBookkeeping()  # tokens, FLOPs, the gradient's normalisation and norm, totals
        self.budget = TimeBudget(**budget) if budget else None  # its schedule is this module's
        self._training_losses = sequence_losses  # compiled by compile_training (trainer.compile)

    def compile_training(self, backend="inductor") -> None:
        """trainer.compile: the loss with dynamic shapes (2 graphs an epoch), the model unwrapped (no `_orig_mod.`)."""
        self._training_losses = torch.compile(sequence_losses, dynamic=True, backend=backend)
        compile_decoding(self.model)

    def _losses(self, batch: dict[str, Tensor], losses=sequence_losses) -> tuple[Tensor, Tensor, Tensor]:
        src, tgt_in, tgt_out = batch["src"], batch["tgt_in"], batch["tgt_out"]
        return losses(self.model, src, tgt_in, tgt_out, self.hparams.label_smoothing, batch.get("target_positions"))

    def configure_callbacks(self) -> list[L.Callback]:
        return [self.updates]  # the update's bookkeeping trains with the module, whoever builds the Trainer

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """A micro-batch's summed loss, backpropagated; the update's last (or the epoch's) steps."""
        with sentence_attention(self.device, self.trainer.precision):
            loss_sum, nll_sum, _ = self._losses(batch, self._training_losses)
        self.updates.add(self, batch, loss_sum, nll_sum)
        last = (batch_idx + 1) % self.accumulation == 0 or epoch_ends(self.trainer)
        strategy = self.trainer.strategy
        # the ranks' gradients are reduced once, at the update's last backward (DDP's no_sync before it); backward
        # outside Lightning's autocast, as in its automatic optimization (and torch's advice)
        accumulate = not last and isinstance(strategy, ParallelStrategy)
        sync = strategy.block_backward_sync() if accumulate else contextlib.nullcontext()
        with sync, torch.autocast(self.device.type, enabled=False):
            self.manual_backward(loss_sum)
        if last:
            self.update()

    def update(self) -> None:
        """One update, as fairseq's: the gradient of the loss summed over every target token of the update (all its
        micro-batches on all ranks) divided by those tokens, so a token weighs the same however the sentences fall
        into micro-batches (§5.1 batches by tokens); its norm; Adam's step, skipped on the device where the norm is
        not finite (found_inf: no wait here; UpdateEnd stops the run); the next update's rate (§5.3)."""
        trainer, optimizer = self.trainer, self.optimizers()
        values = self.updates.counts(trainer)  # [target tokens, FLOPs, clock, signals, loss, NLL] on the device
        if trainer.world_size > 1:
            torch.distributed.all_reduce(values)  # every rank's
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        # DDP and FSDP averaged the ranks' gradients: times the world size is their sum. torch's multi-tensor ops
        # (one kernel for every gradient) have no public name yet; its optimizers use them
        torch._foreach_mul_(grads, (trainer.world_size / values[0].clamp(min=1)).float())
        self.updates.norm = norm = gradient_norm(self.parameters())
        optimizer.optimizer.found_inf = (~norm.isfinite()).float()  # fused Adam then leaves weights and moments
        optimizer.step()
        optimizer.zero_grad()
        self.lr_schedulers().step()
        self.updates.ended(norm, values)

    def configure_optimizers(self):
        h = self.hparams
        # fused: one kernel for all parameters (CPU and CUDA), measurably faster than the loop
        optimizer = torch.optim.Adam(self.parameters(), lr=1.0, betas=tuple(h.betas), eps=h.eps, fused=True)
        d_model = self.model.cfg.d_model
        # LambdaLR calls this with the number of updates done so far; update n (from 1) uses noam(n).
        rate = lambda done: noam_lr(done + 1, d_model, h.warmup_steps, h.lr_factor)  # noqa: E731
        if budget := self.budget:  # Noam's peak at optim.warmup_steps, fitted to the budget
            budget.peak = noam_lr(h.warmup_steps, d_model, h.warmup_steps, h.lr_factor)
            budget.ceiling, budget.provisional = self.trainer.max_steps, max(h.warmup_steps, 1)
            rate = lambda done: budget.lr(done)  # noqa: E731 (a function: LambdaLR keeps no state of it)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, rate)}

    def on_validation_epoch_start(self) -> None:
        self._sums = torch.zeros(3, device=self.device)  # smoothed loss, NLL, target tokens
        self._hyps: dict[int, tuple[list[int], str]] = {}  # index in the split -> (hypothesis ids, reference)
        # Under FSDP a whole copy, gathered on every rank alike: decoding through the shards would hang
        sharded = isinstance(self.trainer.strategy, LayerFSDP) and self.trainer.world_size > 1
        self._decoder = full_copy(self.model) if sharded else self.model

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        with sentence_attention(self.device, self.trainer.precision):
            loss_sum, nll_sum, n_tokens = self._losses(batch)
        self._sums += torch.stack([loss_sum, nll_sum, n_tokens.to(loss_sum.dtype)]).detach()
        if self.hparams.val_bleu_sentences and not self.trainer.sanity_checking:
            rows = batch["index"] < self.hparams.val_bleu_sentences
            if rows.any():
                hyps = greedy(self._decoder, batch["src"][rows])
                references = [ref for ref, keep in zip(batch["reference"], rows.tolist()) if keep]
                self._hyps.update(zip(batch["index"][rows].tolist(), zip(hyps, references)))

    def on_validation_epoch_end(self) -> None:
        self._decoder = None
        loss_sum, nll_sum, n_tokens = self.trainer.strategy.reduce(self._sums, reduce_op="sum")
        loss, nll = loss_sum / n_tokens, nll_sum / n_tokens
        metrics = {"val/loss": loss, "val/nll": nll, "val/ppl": torch.exp(nll)}
        summary = f"validation at update {self.global_step}: loss {loss:.3f}, ppl {torch.exp(nll):.2f}"
        if self.hparams.val_bleu_sentences and not self.trainer.sanity_checking:
            scores = self._score_hypotheses()
            metrics.update({f"val/{name}": value for name, value in scores.items()})
            bleu, chrf, n = scores["bleu"], scores["chrf"], len(self._hyps)
            summary += f", greedy sacreBLEU {bleu:.2f}, chrF {chrf:.2f} ({n} sentences)"
        # Every rank holds the same values (sums reduced, hypotheses gathered): checkpoint monitors agree.
        shown = {k: metrics[k] for k in ("val/loss", "val/bleu") if k in metrics}
        self.log_dict(shown, prog_bar=True, sync_dist=True, logger=False)  # checkpoints, early stopping, the bar
        self.log_dict({k: v for k, v in metrics.items() if k not in shown}, sync_dist=True, logger=False)
        if not self.trainer.sanity_checking:  # at the step of the update's own row (Lightning's counts micro-batches)
            log_metrics(self.trainer, {"epoch": self.current_epoch, **metrics}, self.global_step - 1)
        if self.trainer.is_global_zero and not self.trainer.sanity_checking:
            log.info(summary)  # the learning curve in the run's log, whatever the logger

    def _score_hypotheses(self) -> dict[str, float]:
        """Corpus scores of the hypotheses of every rank, detokenized, in split order."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            shards = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(shards, self._hyps)
            self._hyps = {i: h for shard in shards for i, h in shard.items()}
        hyps, references = zip(*(self._hyps[i] for i in sorted(self._hyps)))
        return corpus_scores(self.tokenizer.decode(list(hyps)), list(references))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # The metrics logged so far reach the disk with every checkpoint: a killed run loses no CSV row before it
        for logger in self.trainer.loggers:
            logger.save()
        if self.tokenizer is not None:
            checkpoint["sentencepiece"] = self.tokenizer.proto
        # the update's padded tokens per side (batch_fit.shape_updates): a resume keeps it (resume.check_update_size)
        checkpoint["update_tokens"] = getattr(self.trainer.datamodule, "update_tokens", None)
        checkpoint["max_tokens"] = getattr(self.trainer.datamodule, "max_tokens", None)  # data.max_tokens=auto's choice
        checkpoint["budget"] = asdict(self.budget) if self.budget else None

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self.budget and checkpoint["budget"]:
            self.budget.resume(checkpoint["budget"])
