"""trainer=fsdp: FSDP2 (`fully_shard`), one unit per layer, as a DDPStrategy that reads and writes full state dicts
(ordinary .ckpt files; Lightning's ModelParallelStrategy writes folders), and the whole copy validation decodes with."""

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

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0, on the host


class LayerFSDP(DDPStrategy):
    """FSDP2 per layer, gradients reduce-scattered once per update; over gloo on CPU processes too."""

    def configure_ddp(self) -> None:  # in place of DDP's wrapper
        device = self.root_device.type
        policy = mixed_precision_policy(self.precision_plugin.precision, device)
        shard(self.lightning_module.model, device, self.world_size, policy)

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """TranslationModule.training_step enters this for each micro-batch but an update's last (DDP's no_sync)."""
        model = self.lightning_module.model
        model.set_requires_gradient_sync(False)  # backward passes whose gradients wait, unsharded, for the next one
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def lightning_module_state_dict(self) -> dict:
        return get_model_state_dict(self.lightning_module, options=FULL)

    def optimizer_state(self, optimizer) -> dict:
        state = get_optimizer_state_dict(self.lightning_module, optimizer, options=FULL)
        if self.global_rank != 0:
            return state  # empty: only rank 0 writes
        # Keyed by parameter index, as a plain optimizer's, not by name
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
    for name in ("features", "project"):  # what the training loss calls: each gathers the root unit as forward does
        register_fsdp_forward_method(model, name)


def mixed_precision_policy(precision: str, device_type: str) -> MixedPrecisionPolicy | None:
    """bf16-mixed: weights gathered in bf16, gradients reduced in fp32; the layers' inputs cast on a CPU only (its
    autocast refuses fp32 into a bf16 LayerNorm; on CUDA the residual stream stays fp32, as under DDP)."""
    bf16 = MixedPrecisionPolicy(torch.bfloat16, torch.float32, cast_forward_inputs=device_type != "cuda")
    return bf16 if precision == "bf16-mixed" else None


def full_copy(model: Transformer) -> Transformer:
    """A plain Transformer holding all of `model`'s weights; every rank calls it at the same point (a collective)."""
    state = {
        name: p.full_tensor().detach() if isinstance(p, DTensor) else p.detach().clone()
        for name, p in model.named_parameters()
    }
    with torch.device("meta"):
        copy = Transformer(model.cfg)  # no initialisation draws from the random generators
    copy.load_state_dict(state, assign=True)  # strict: a name sharding changed would fail here
    for name, buffer in model.named_buffers():  # not sharded: the model's own, shared (never written)
        owner, _, leaf = name.rpartition(".")
        copy.get_submodule(owner).register_buffer(leaf, buffer, persistent=False)
    return copy.train(model.training)
