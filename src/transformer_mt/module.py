"""The LightningModule: loss (§5.4), Adam + Noam schedule (§5.3), validation loss and BLEU."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import lightning as L
import sacrebleu
import torch
import torch.nn.functional as F
from torch import Tensor

from transformer_mt.model import Transformer, TransformerConfig
from transformer_mt.tokenizer import PAD_ID, Tokenizer

log = logging.getLogger(__name__)


def label_smoothed_nll(logits: Tensor, target: Tensor, epsilon: float, pad_id: int = PAD_ID) -> tuple[Tensor, Tensor, Tensor]:
    """§5.4 label smoothing. Returns (smoothed loss, NLL, token count), summed over non-pad targets.

    Target distribution q = (1 - eps) * onehot(y) + eps / V, uniform over the whole vocabulary,
    as in F.cross_entropy(label_smoothing=eps) (fairseq instead gives the true class exactly
    1 - eps). Loss = -sum_k q_k log p_k = (1 - eps) * NLL + eps * mean_k(-log p_k).
    """
    pad = target.eq(pad_id)
    lprobs = F.log_softmax(logits.float(), dim=-1)  # (..., V)
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (...)
    smooth = -lprobs.mean(-1)  # (...)
    loss = (1.0 - epsilon) * nll + epsilon * smooth
    return loss.masked_fill(pad, 0.0).sum(), nll.masked_fill(pad, 0.0).sum(), (~pad).sum()


def noam_lr(step: int, d_model: int, warmup_steps: int, factor: float = 1.0) -> float:
    """§5.3: lrate = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step >= 1."""
    step = max(step, 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


class TranslationModule(L.LightningModule):
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
    ):
        super().__init__()
        self.save_hyperparameters()  # plain values only: no nn.Module, no DictConfig
        self.model = Transformer(TransformerConfig(**model))
        self._val_sums = torch.zeros(3)  # smoothed loss, NLL, target tokens
        self._test_hyps: dict[int, list[int]] = {}
        self._last_batch_end: float | None = None

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        return self.model(src, tgt_in)

    def _losses(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        hidden = self.model.features(batch["src"], batch["tgt_in"])  # (B, T, d)
        keep = batch["tgt_out"].ne(self.model.cfg.pad_id)
        logits = self.model.project(hidden[keep])  # (N, V): no vocabulary-sized work for padding
        return label_smoothed_nll(logits, batch["tgt_out"][keep], self.hparams.label_smoothing, self.model.cfg.pad_id)

    # -- training

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss_sum, nll_sum, n_tokens = self._losses(batch)
        loss = loss_sum / n_tokens  # per target token; Lightning averages over accumulated batches
        nll = nll_sum / n_tokens
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/nll", nll)
        self.log("train/ppl", torch.exp(nll))
        return loss

    def on_train_batch_end(self, outputs, batch: dict[str, Tensor], batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last_batch_end is not None:  # data loading + step time of this batch
            seconds = now - self._last_batch_end
            self.log("train/src_tok_per_s", batch["src"].ne(PAD_ID).sum().item() / seconds)
            self.log("train/tgt_tok_per_s", batch["tgt_out"].ne(PAD_ID).sum().item() / seconds, prog_bar=True)
        self._last_batch_end = now

    def on_before_optimizer_step(self, optimizer) -> None:
        norms = [p.grad.detach().norm() for p in self.parameters() if p.grad is not None]
        self.log("train/grad_norm", torch.stack(norms).norm())

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

    # -- validation

    def on_validation_epoch_start(self) -> None:
        self._val_sums = torch.zeros(3, device=self.device)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss_sum, nll_sum, n_tokens = self._losses(batch)
        self._val_sums += torch.stack([loss_sum, nll_sum, n_tokens.to(loss_sum.dtype)]).detach()

    def on_validation_epoch_end(self) -> None:
        loss_sum, nll_sum, n_tokens = self.trainer.strategy.reduce(self._val_sums, reduce_op="sum")
        if n_tokens == 0:
            raise RuntimeError("validation saw no target tokens: the validation loader yielded no batch")
        self.log("val/loss", loss_sum / n_tokens, prog_bar=True, rank_zero_only=True)
        self.log("val/nll", nll_sum / n_tokens, rank_zero_only=True)
        self.log("val/ppl", torch.exp(nll_sum / n_tokens), rank_zero_only=True)
        summary = f"validation at update {self.global_step}: loss {loss_sum / n_tokens:.3f}, ppl {torch.exp(nll_sum / n_tokens):.2f}"
        if self.hparams.val_bleu_sentences and not self.trainer.sanity_checking:
            bleu = self.validation_bleu()
            self.log("val/bleu", bleu, prog_bar=True, rank_zero_only=True)
            summary += f", greedy sacreBLEU {bleu:.2f} ({self.hparams.val_bleu_sentences} sentences)"
        if self.trainer.is_global_zero and not self.trainer.sanity_checking:
            log.info(summary)  # the learning curve in the run's log, whatever the logger

    def validation_bleu(self) -> float:
        """sacreBLEU of greedy translations of the first validation sentences, on detokenized text."""
        from transformer_mt.search import translate_ids  # noqa: PLC0415 (search imports this package)

        dm = self.trainer.datamodule
        data = dm.splits["validation"]
        n = min(self.hparams.val_bleu_sentences, len(data))
        sources = [data[i][0] for i in range(n)]
        hyps = dm.tokenizer.decode(translate_ids(self.model, sources, beam_size=1, max_tokens=dm.max_tokens))
        refs = data.texts("tgt_text")[:n]
        return sacrebleu.corpus_bleu(hyps, [refs]).score

    # -- test: beam search on the data config's test split

    def on_test_epoch_start(self) -> None:
        self.on_validation_epoch_start()
        self._test_hyps = {}

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        from transformer_mt.search import beam_search  # noqa: PLC0415

        self.validation_step(batch, batch_idx)
        options = {k: v for k, v in (self.hparams.decoding or {}).items() if k != "max_tokens"}  # batches are given
        hyps, _ = beam_search(self.model, batch["src"], **options)  # beam_search's defaults are §6.1's
        self._test_hyps.update(zip(batch["index"].tolist(), hyps))

    def on_test_epoch_end(self) -> None:
        loss_sum, nll_sum, n_tokens = self.trainer.strategy.reduce(self._val_sums, reduce_op="sum")
        self.log("test/loss", loss_sum / n_tokens, rank_zero_only=True)
        self.log("test/ppl", torch.exp(nll_sum / n_tokens), rank_zero_only=True)
        hyps = self._test_hyps
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            shards = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(shards, hyps)
            hyps = {i: h for shard in shards for i, h in shard.items()}
        dm = self.trainer.datamodule
        refs = dm.splits["test"].texts("tgt_text")
        texts = dm.tokenizer.decode([hyps[i] for i in range(len(refs))])
        self.log("test/bleu", sacrebleu.corpus_bleu(texts, [refs]).score, rank_zero_only=True)
        self.log("test/chrf", sacrebleu.corpus_chrf(texts, [refs]).score, rank_zero_only=True)

    # -- checkpoints

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # The SentencePiece model travels inside every checkpoint: the file alone can translate.
        dm = self._trainer.datamodule if self._trainer is not None else None
        if dm is not None and dm.tokenizer is not None:
            checkpoint["sentencepiece"] = dm.tokenizer.proto


def write_checkpoint(checkpoint: dict, path: str | Path) -> Path:
    """torch.save to a temporary file, then rename: a crash never leaves a truncated checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(checkpoint, tmp)
    os.replace(tmp, path)
    return path


def read_checkpoint(path: str | Path) -> dict:
    """torch.load with weights_only=True, and a clear error for files that are not ours."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated file, pickle of arbitrary objects, not a torch file ...
        raise ValueError(f"{path}: cannot be read as a checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint or "model" not in checkpoint.get("hyper_parameters", {}):
        raise ValueError(f"{path}: not a transformer_mt checkpoint (no state_dict / hyper_parameters.model)")
    return checkpoint


def load_for_inference(path: str | Path) -> tuple[Transformer, Tokenizer, dict]:
    """A checkpoint (trained or averaged) -> eval-mode model, its SentencePiece model, the raw dict."""
    checkpoint = read_checkpoint(path)
    model = Transformer(TransformerConfig(**checkpoint["hyper_parameters"]["model"]))
    # Weights live under "model." in the LightningModule; torch.compile adds "_orig_mod.".
    state = {k.removeprefix("model.").replace("_orig_mod.", ""): v for k, v in checkpoint["state_dict"].items()}
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{path}: weights do not fit the model its hyper_parameters describe: {e}") from None
    if "sentencepiece" not in checkpoint:
        raise ValueError(f"{path}: has no SentencePiece model inside (written by an older version?)")
    tokenizer = Tokenizer(proto=checkpoint["sentencepiece"], origin=f"{path} (sentencepiece)")
    return model.eval(), tokenizer, checkpoint
