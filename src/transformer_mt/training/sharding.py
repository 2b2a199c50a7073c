"""trainer=fsdp: PyTorch's FSDP2 (`fully_shard`) with one unit per encoder/decoder layer, and the full copy
of the weights that validation and test decode with.

Under FSDP every forward of a sharded layer is a collective (an all-gather of its shards). Ranks decode
different numbers of steps (different sentences, output lengths, early stops), so decoding through the
sharded model would issue rank-dependent numbers of collectives: a hang. Decoding runs on a plain copy of
the whole model instead, gathered once per validation on every rank alike.

Why the project's own strategy and not Lightning 2.6's `ModelParallelStrategy` (its only road to FSDP2):
that one is experimental, requires the LightningModule to shard itself in `configure_model` (parallelism
code in the module), defaults to tensor parallelism across a node's devices (`data_parallel_size` would
have to be the world size, unknown when the config is read), and writes distributed checkpoint folders
unless told otherwise. Lightning's DDP strategy already starts the ranks, sets up the process group and
reduces metrics; this subclass replaces only the DDP wrapper with `fully_shard` and reads and writes full
state dicts, so every checkpoint is an ordinary .ckpt that averaging, export, evaluate and resume read.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from transformer_mt.model import Transformer

# The Transformer's methods the training loss calls (objective.sequence_losses), each gathering the root
# unit (embeddings, final norms) as its forward would.
FORWARD_METHODS = ("features", "project")
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0, on the host


class LayerFSDP(DDPStrategy):
    """FSDP2 per encoder/decoder layer, the embeddings and final norms in the root unit (the Transformer).
    In bf16 the parameters are gathered in bf16 (the products run in bf16, under Lightning's autocast as with
    DDP) and gradients are reduced in fp32; buffers (the sinusoid table) are never cast. Inside an accumulation
    the gradients are not reduce-scattered until the update's last micro-batch, as DDP's no_sync. The same class
    runs on CPU processes over gloo, which is how the slow test tier trains with it."""

    def __init__(self, precision: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.precision = precision

    @property
    def mixed_precision_config(self) -> MixedPrecisionPolicy | None:
        return mixed_precision_policy(self.precision, self.root_device.type)

    def configure_ddp(self) -> None:  # in place of DDP's wrapper
        shard(self.lightning_module.model, self.root_device.type, self.world_size, self.mixed_precision_config)

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's loop enters this for every micro-batch of an update but the last (DDP's no_sync)."""
        with no_gradient_sync(self.lightning_module.model):
            yield

    def lightning_module_state_dict(self) -> dict:
        return get_model_state_dict(self.lightning_module, options=FULL)

    def optimizer_state(self, optimizer) -> dict:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's own
        state = get_optimizer_state_dict(self.lightning_module, optimizer, options=FULL)
        if self.global_rank != 0:
            return state  # empty: only rank 0 writes
        # Keyed by parameter index, as a plain optimizer's (DDP's checkpoints), not by name.
        index = {name: i for i, name in enumerate(n for group in state["param_groups"] for n in group["params"])}
        groups = [{**group, "params": [index[n] for n in group["params"]]} for group in state["param_groups"]]
        return {"state": {index[n]: s for n, s in state["state"].items()}, "param_groups": groups}

    def load_optimizer_state_dict(self, checkpoint: dict) -> None:
        """Every rank takes its shard of the full state the checkpoint holds."""
        names = [name for name, _ in self.lightning_module.named_parameters()]  # the optimizer's order
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            groups = [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]]
            by_name = {"state": {names[i]: s for i, s in state["state"].items()}, "param_groups": groups}
            set_optimizer_state_dict(self.lightning_module, optimizer, by_name, options=FULL)


def shard(model: Transformer, device_type: str, world_size: int, policy: MixedPrecisionPolicy | None) -> None:
    """Shards `model` in place over all ranks, one unit per layer: parameter names stay the plain model's."""
    mesh = init_device_mesh(device_type, (world_size,))
    policy = policy or MixedPrecisionPolicy()  # none: every dtype the parameters' own
    for layer in [*model.encoder_layers, *model.decoder_layers]:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for name in FORWARD_METHODS:
        register_fsdp_forward_method(model, name)


def mixed_precision_policy(precision: str | None, device_type: str) -> MixedPrecisionPolicy | None:
    """trainer=fsdp's FSDP2 policy: in bf16-mixed, weights gathered in bf16 and gradients reduced in fp32. On CUDA
    the layers' inputs are not cast (FSDP2 casts them to bf16 by default: the residual stream and the encoder's
    output would be rounded at every layer, where DDP keeps them fp32; CUDA's autocast runs LayerNorm in fp32
    with its bf16 weights cast up). On a CPU they are: CPU autocast runs LayerNorm in its input's dtype and refuses
    an fp32 input with bf16 weights, so there the stream enters each layer in bf16 (DDP's: fp32)."""
    if precision != "bf16-mixed":
        return None
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=device_type != "cuda"
    )


@contextmanager
def no_gradient_sync(model: Transformer) -> Iterator[None]:
    """Backward passes that keep their gradients unsharded on each rank, to be reduce-scattered with the next
    synchronised one (FSDP2's set_requires_gradient_sync): one reduce-scatter per update, not per micro-batch."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def is_sharded(strategy) -> bool:
    """Each rank holds only a shard of the weights and gradients."""
    return isinstance(strategy, LayerFSDP)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (a DTensor); any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_copy(model: Transformer) -> Transformer:
    """A plain Transformer holding all of `model`'s weights, on every rank. Every rank must call this at the
    same point, since gathering is a collective (one all-gather per sharded parameter, in the same order)."""
    state = {
        name: p.full_tensor().detach() if isinstance(p, DTensor) else p.detach().clone()
        for name, p in model.named_parameters()
    }
    # Built on the meta device: no initialisation, so no draw from the random generators, whose state
    # (dropout's masks, checkpoints) must not depend on when validations ran.
    with torch.device("meta"):
        copy = Transformer(model.cfg)
    copy.load_state_dict(state, assign=True)  # strict: a name sharding changed would fail here
    for name, buffer in model.named_buffers():  # not sharded: the model's own, shared (never written)
        owner, _, leaf = name.rpartition(".")
        copy.get_submodule(owner).register_buffer(leaf, buffer, persistent=False)
    return copy.train(model.training)
