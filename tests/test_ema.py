"""The moving average of the weights (training/ema.py): once per update, its formula, and carried through a resume
in the checkpoint bit for bit."""

from types import SimpleNamespace

import torch
from torch import nn

from conftest import VARIANT_RUN, assert_same_training_state, train_in_process, write_corpus
from transformer_mt.checkpoint import EMA_KEY as STATE_KEY
from transformer_mt.checkpoint import ema_state, read_checkpoint
from transformer_mt.training.ema import ExponentialMovingAverage


def test_the_moving_average_is_the_formula_once_per_update():
    """ema_0 = the initial weights; after update t (UpdateEnd calls after_update), ema_t = d ema_{t-1} + (1 - d) w_t."""
    decay = 0.75
    module = SimpleNamespace(model=nn.Linear(3, 2))
    ema = ExponentialMovingAverage(decay)
    ema.on_train_start(SimpleNamespace(global_step=0), module)
    expected = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    for _ in range(3):
        with torch.no_grad():
            for p in module.model.parameters():
                p.add_(torch.randn_like(p))
        ema.after_update(module)
        for name, p in module.model.named_parameters():
            expected[name] = decay * expected[name] + (1 - decay) * p.detach()
            torch.testing.assert_close(ema.average[name], expected[name], rtol=1e-6, atol=1e-6)
    assert ema.state_dict()["updates"] == 3


def test_a_resumed_run_continues_the_same_moving_average_bit_for_bit(tmp_path):
    """3 updates, stop, resume to 6 == 6 updates in one go (dropout 0.1 as every shipped config): the
    average, the weights and the training totals travel in the checkpoint."""
    corpus = write_corpus(tmp_path / "corpus")
    args = [f"data.path={corpus}", *VARIANT_RUN]
    train_in_process([*args, "trainer.max_steps=6"], tmp_path, tmp_path / "straight")
    train_in_process([*args, "trainer.max_steps=3"], tmp_path, tmp_path / "resumed")
    train_in_process([*args, "trainer.max_steps=6", "ckpt_path=last"], tmp_path, tmp_path / "resumed")
    straight, resumed = (
        read_checkpoint(tmp_path / run / "checkpoints" / "last.ckpt") for run in ("straight", "resumed")
    )
    for key, value in ema_state(straight).items():
        assert torch.equal(ema_state(resumed)[key], value), key
        assert not torch.equal(straight["state_dict"][key], value)  # an average, not the weights
    assert straight["callbacks"][STATE_KEY]["updates"] == resumed["callbacks"][STATE_KEY]["updates"] == 6
    assert straight["totals"]["target_tokens"] == resumed["totals"]["target_tokens"] > 0
    assert_same_training_state(*(tmp_path / run / "checkpoints" / "last.ckpt" for run in ("straight", "resumed")), 6)
