"""trainer=fsdp: Lightning's FSDP with one unit per encoder/decoder layer, and the full copy of the
weights that validation and test decode with.

Under FSDP every forward of a wrapped layer is a collective (an all-gather of its shards). Ranks
decode different numbers of steps (different sentences, output lengths, early stops), so decoding
through the wrapped model would issue rank-dependent numbers of collectives: a hang. Decoding runs
on a plain copy of the whole model instead, gathered once per validation on every rank alike.
"""

from __future__ import annotations

import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel,
    MixedPrecision,
    OptimStateKeyType,
    StateDictType,
)

from transformer_mt.model import DecoderLayer, EncoderLayer, Transformer

WRAPPED = "_fsdp_wrapped_module."  # in parameter names under FSDP


class LayerFSDP(FSDPStrategy):
    """FSDP wrapped per encoder/decoder layer (the embedding in the root unit). In bf16 the products run
    in bf16 but gradients are reduced in fp32 and buffers (the sinusoid table) stay fp32: Lightning's
    default for bf16-mixed reduces and casts buffers in bf16 too.

    It also runs on CPU processes over gloo, which is how the slow test tier trains with it: Lightning
    refuses the strategy *name* "fsdp" without CUDA (an exact-type check this subclass passes),
    torch's FSDP on the CPU needs `device_id` set to the CPU, where Lightning passes None, and the
    checkpoint's full state dicts are gathered without `offload_to_cpu`, which on the CPU frees the
    very tensors it would copy (a segmentation fault while saving). On CUDA it is Lightning's own.
    """

    def __init__(self, precision: str | None = None, **kwargs):
        mixed = MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
        super().__init__(
            auto_wrap_policy={EncoderLayer, DecoderLayer},
            mixed_precision=mixed if precision == "bf16-mixed" else None,
            **kwargs,
        )

    def _setup_model(self, model: nn.Module) -> nn.Module:
        if self.root_device.type != "cpu":
            return super()._setup_model(model)
        return FullyShardedDataParallel(
            model,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self.root_device,
            **self.kwargs,
        )

    def _full_state_dicts(self):
        """As Lightning's, gathered on rank 0, without offload_to_cpu."""
        return FullyShardedDataParallel.state_dict_type(
            self.model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
        )

    def lightning_module_state_dict(self) -> dict:
        if self.root_device.type != "cpu":
            return super().lightning_module_state_dict()
        with self._full_state_dicts():
            return self.model.state_dict()

    def optimizer_state(self, optimizer) -> dict:
        if self.root_device.type != "cpu":
            return super().optimizer_state(optimizer)
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's own
        with self._full_state_dicts():
            state = FullyShardedDataParallel.optim_state_dict(self.model, optimizer)
            if self.global_rank == 0:  # keyed by parameter index, as a plain optimizer's (and Lightning's)
                state = FullyShardedDataParallel.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
            return state


def is_sharded(strategy) -> bool:
    """Each rank holds only a shard of the weights and gradients."""
    return isinstance(strategy, FSDPStrategy)


def full_copy(root: nn.Module, model: Transformer) -> Transformer:
    """A plain Transformer holding all of `model`'s weights, on every rank. `root` is the outermost FSDP
    unit (trainer.model); every rank must call this at the same point, since gathering is a collective."""
    with FullyShardedDataParallel.summon_full_params(root, writeback=False):
        state = {name.replace(WRAPPED, ""): p.detach().clone() for name, p in model.named_parameters()}
    # Built on the meta device: no initialisation, so no draw from the random generators, whose state
    # (dropout's masks, checkpoints) must not depend on when validations ran.
    with torch.device("meta"):
        copy = Transformer(model.cfg)
    copy.load_state_dict(state, assign=True)  # strict: a name FSDP changed would fail here
    for name, buffer in model.named_buffers():  # not sharded: the model's own, shared (never written)
        owner, _, leaf = name.replace(WRAPPED, "").rpartition(".")
        copy.get_submodule(owner).register_buffer(leaf, buffer, persistent=False)
    return copy.train(model.training)
