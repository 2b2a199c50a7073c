"""Where the Hydra configs live (transformer_mt/conf: a link to the checkout's conf/, a copy once installed), their
resolvers, and composing them outside an entry point (scripts, tests) exactly as Hydra does."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from transformer_mt.decoding import PAPER, TUNE_GRID
from transformer_mt.launcher import launch_id

CONF_DIR = str(Path(__file__).resolve().parent / "conf")


def run_folder() -> str:
    """${run_folder:} in train.yaml's hydra.run.dir: <date>/<time>, or under torchrun/srun the job's name (one folder
    for every rank, and for the job restarted)."""
    return launch_id() or datetime.now().strftime("%Y-%m-%d/%H-%M-%S")


def own_folder() -> str:
    """${own_folder:} in evaluate's and tune's hydra.run.dir: <date>_<time>-<pid> (two commands in one second)."""
    return f"{datetime.now():%Y-%m-%d_%H-%M-%S}-{os.getpid()}"


OmegaConf.register_new_resolver("run_folder", run_folder, replace=True)
OmegaConf.register_new_resolver("own_folder", own_folder, replace=True)
# ${tune_grid:alphas} in conf/tune.yaml and conf/train.yaml's final block: make tune's grid, decoding.TUNE_GRID
OmegaConf.register_new_resolver("tune_grid", lambda key: list(TUNE_GRID[key]), replace=True)

# decoding=beam, the group's default: §6.1's search as decoding.PAPER writes it once (conf/decoding/greedy.yaml builds
# on it), stored as plain values (overridable: decoding.alpha=1.0).
ConfigStore.instance().store(group="decoding", name="beam", node=PAPER.settings())


@contextmanager
def hydra_on_conf() -> Iterator:
    """Hydra's global state on conf/ (inside a Hydra app, the app's own); yields its config loader."""
    if GlobalHydra.instance().is_initialized():
        yield GlobalHydra.instance().config_loader()
        return
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        yield GlobalHydra.instance().config_loader()


def compose(config_name: str = "train", overrides: Sequence[str] = ()) -> DictConfig:
    """A primary config (train, evaluate, translate) with command-line style overrides."""
    with hydra_on_conf():
        return hydra_compose(config_name, overrides=list(overrides))


def model_preset(name: str) -> dict:
    """conf/model/<name>.yaml (small, base, big) as TransformerConfig's keyword arguments (no vocabulary)."""
    return OmegaConf.to_container(compose("train", [f"model={name}"]).model, resolve=True)
