"""training/update.py: an accumulated update's gradient is one batch's, its token and FLOP totals, its
one wait for the device over a whole real run, and a non-finite update stops the run with finite weights."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from conftest import MICRO_SHAPE, micro_batches, quiet_trainer, train_in_process
from device_waits import WAITS_RUN, DeviceWaits, counted_run, summary
from transformer_mt.data.batching import collate
from transformer_mt.model import Transformer, TransformerConfig, training_flops
from transformer_mt.objective import sequence_losses
from transformer_mt.tokenizer import PAD_ID
from transformer_mt.training.module import TranslationModule
from transformer_mt.training.update import TrainingDiverged, UpdateEnd


class KeepGradients(TranslationModule):
    def on_before_optimizer_step(self, optimizer) -> None:
        super().on_before_optimizer_step(optimizer)  # after update() normalised the gradient
        self.kept = {name: p.grad.clone() for name, p in self.named_parameters()}


def test_an_accumulated_update_has_the_gradient_of_one_batch_holding_its_sentences():
    """Every target token of an update weighs the same (fairseq's normalisation): 3 micro-batches of
    1, 2 and 5 sentences give the gradient of one batch of all 8, not the mean of 3 per-batch means."""
    model_cfg = {**MICRO_SHAPE, "dropout": 0.0}
    g = torch.Generator().manual_seed(0)
    items = [
        (torch.randint(4, 20, (n,), generator=g).numpy(), torch.randint(4, 20, (n + 3,), generator=g).numpy(), i)
        for i, n in enumerate([9, 2, 3, 4, 2, 5, 1, 6])
    ]
    micro_batches = [collate(items[:1]), collate(items[1:3]), collate(items[3:])]
    torch.manual_seed(0)
    module = KeepGradients(model_cfg, val_bleu_sentences=0)
    torch.manual_seed(0)
    reference = Transformer(TransformerConfig(**model_cfg))
    module.accumulation = 3
    trainer = quiet_trainer(max_steps=1)
    trainer.fit(module, DataLoader(micro_batches, batch_size=None))
    whole = collate(items)
    loss_sum, _, n_tokens = sequence_losses(reference, whole["src"], whole["tgt_in"], whole["tgt_out"], 0.1)
    (loss_sum / n_tokens).backward()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(module.kept[f"model.{name}"], param.grad, atol=1e-6, rtol=1e-5, msg=name)
    # ... and not what per-micro-batch means averaged by Lightning would give (the defect this replaces)
    means = []
    for batch in micro_batches:
        reference.zero_grad()
        loss_sum, _, n_tokens = sequence_losses(reference, batch["src"], batch["tgt_in"], batch["tgt_out"], 0.1)
        (loss_sum / n_tokens / 3).backward()
        means.append(reference.embed.tokens.weight.grad.clone())
    assert not torch.allclose(sum(means), module.kept["model.embed.tokens.weight"], atol=1e-4)


def test_a_whole_training_run_waits_for_the_device_once_per_update(corpus, tmp_path):
    """On a GPU every read of a device value drains the kernel queue, and so does a device tensor built from
    Python values. Over a whole run of transformer_mt.train, each update waits once (its gradient norm, loss
    and counts, read together), wherever in Lightning's loop a wait would hide; checkpoint writes and
    validations are counted apart (main before the update callback: 135 waits in these 6 updates)."""
    counter = DeviceWaits()
    counted_run(counter, train_in_process, [f"data.path={corpus}", *WAITS_RUN], tmp_path, tmp_path / "run")
    updates = counter.per_update()
    assert sorted(updates) == [1, 2, 3, 4, 5, 6], summary(counter)
    for update, waits in updates.items():
        assert len(waits) == 1 and waits[0].startswith("tolist at update.py"), (update, waits)
    assert {w["kind"] for w in counter.found if isinstance(w["phase"], int)} >= {"update", "checkpoint", "validation"}
    # The host's counts are the padded tensors': target tokens, and model FLOPs of the real lengths.
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["totals"]["target_tokens"] > 0 and last["totals"]["model_flops"] > 0


def test_the_updates_token_and_flop_totals_are_the_padded_tensors(tmp_path):
    batches = micro_batches()
    module = TranslationModule(MICRO_SHAPE, val_bleu_sentences=0)
    module.accumulation = 3
    trainer = quiet_trainer(
        max_steps=2,
        use_distributed_sampler=False,
        default_root_dir=tmp_path,
        callbacks=[UpdateEnd()],  # reads each update: its totals (the parts fit.make_callbacks adds are not needed)
    )
    trainer.fit(module, DataLoader(batches, batch_size=None))
    cfg, totals = module.model.cfg, module.updates.totals
    tokens = sum(int(b["tgt_out"].ne(PAD_ID).sum()) for b in batches)
    flops = sum(training_flops(cfg, b["src"].ne(PAD_ID).sum(1), b["tgt_out"].ne(PAD_ID).sum(1)) for b in batches)
    assert totals["target_tokens"] == tokens and totals["model_flops"] == pytest.approx(flops, rel=1e-12)
    assert module.updates.current.step == 2 and module.updates.current.tokens == sum(
        int(b["tgt_out"].ne(PAD_ID).sum()) for b in batches[3:]
    )
    # Without collate's positions, the loss would find its rows on the device: the counter sees that.
    with DeviceWaits() as counter:
        sequence_losses(module.model, batches[0]["src"], batches[0]["tgt_in"], batches[0]["tgt_out"], 0.1)
    assert [w["what"] for w in counter.found] == ["nonzero"]


class NaNAtUpdate2(TranslationModule):
    def _losses(self, batch, losses=sequence_losses):
        loss_sum, nll_sum, n_tokens = super()._losses(batch, losses)
        self.micro_batches = getattr(self, "micro_batches", 0) + 1
        return loss_sum * float("nan") if self.micro_batches == 5 else loss_sum, nll_sum, n_tokens  # in update 2


class KeepState(L.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if batch_idx == 2:  # update 1 done
            self.weights = {k: v.clone() for k, v in module.state_dict().items()}
            self.moments = {k: v.clone() for k, v in trainer.optimizers[0].state_dict()["state"][0].items()}


def test_a_non_finite_update_stops_the_run_with_weights_and_adam_as_the_update_before_left_them(tmp_path):
    """The update's one wait comes after its step, so the device skips a non-finite step itself (fused Adam's
    found_inf): the run stops with TrainingDiverged, and weights and Adam's moments and step count are those of
    the last finite update."""
    keep = KeepState()
    trainer = quiet_trainer(
        max_steps=2,
        use_distributed_sampler=False,
        callbacks=[keep, UpdateEnd()],
        default_root_dir=tmp_path,
    )
    module = NaNAtUpdate2(MICRO_SHAPE, val_bleu_sentences=0)
    module.accumulation = 3
    with pytest.raises(TrainingDiverged, match="training diverged at update 2: the gradient norm is nan"):
        trainer.fit(module, DataLoader(micro_batches(), batch_size=None))
    for name, value in module.state_dict().items():
        assert torch.equal(value, keep.weights[name]), name
    state = trainer.optimizers[0].state_dict()["state"][0]
    assert state["step"].item() == 1 and all(torch.equal(state[k], v) for k, v in keep.moments.items())
