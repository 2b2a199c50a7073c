"""Lightning's `trainer.test` of a checkpoint (beam search on the test split of its data config), in
every process torchrun starts, with trainer=fsdp's strategy when asked; rank 0 writes the metrics.

    torchrun --nproc-per-node=2 tests/lightning_test_split.py <ckpt> <fsdp|ddp|none> <metrics.json>
"""

import json
import os
import sys

import lightning as L

from transformer_mt.checkpoint import read_checkpoint
from transformer_mt.data.datamodule import TranslationDataModule
from transformer_mt.runtime import end_process_group
from transformer_mt.training.module import TranslationModule
from transformer_mt.training.sharding import LayerFSDP


def main(ckpt: str, strategy: str, out: str) -> None:
    datamodule = TranslationDataModule(**read_checkpoint(ckpt)["hyper_parameters"]["config"]["data"])
    module = TranslationModule.load_from_checkpoint(ckpt, weights_only=True)
    world = int(os.environ.get("WORLD_SIZE", 1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy={"fsdp": LayerFSDP(), "ddp": "ddp", "none": "auto"}[strategy],
        precision="32-true",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # as conf/trainer: the token-bucket sampler shards by rank itself
    )
    metrics = trainer.test(module, datamodule, verbose=False)[0]
    if trainer.is_global_zero:
        with open(out, "w") as f:
            json.dump({"world_size": trainer.world_size, "strategy": type(trainer.strategy).__name__, **metrics}, f)


main(*sys.argv[1:])
# As train.py: with the Trainer gone, the process group goes too (gloo's threads joined before the exit).
assert not (still_running := end_process_group()), f"the process group outlived the Trainer: {still_running}"
