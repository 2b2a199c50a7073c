"""Where the Hydra configs live (transformer_mt/conf), their resolvers, and composing them outside an entry point."""

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

from transformer_mt import settings
from transformer_mt.decoding import PAPER, TUNE_GRID
from transformer_mt.launcher import launch_id

CONF_DIR = str(Path(__file__).resolve().parent / "conf")


def run_folder() -> str:
    """${run_folder:} (train.yaml's run dir): <date>/<time>, or the launched job's name, one folder for every rank."""
    return launch_id() or datetime.now().strftime("%Y-%m-%d/%H-%M-%S")


OmegaConf.register_new_resolver("run_folder", run_folder, replace=True)
# evaluate's and tune's run dir: <date>_<time>-<pid> (two commands in one second)
OmegaConf.register_new_resolver("own_folder", lambda: f"{datetime.now():%Y-%m-%d_%H-%M-%S}-{os.getpid()}", replace=True)
OmegaConf.register_new_resolver("tune_grid", lambda key: list(TUNE_GRID[key]), replace=True)  # make tune's grid
ConfigStore.instance().store(group="model", name="schema", node=settings.ModelSettings)  # model/default.yaml's types
ConfigStore.instance().store(group="data", name="schema", node=settings.DataSettings)  # data/default.yaml's types
# <command>.yaml's types, first in its defaults
ConfigStore.instance().store(name="train_settings", node=settings.TrainSettings)
ConfigStore.instance().store(name="evaluate_settings", node=settings.EvaluateSettings)
ConfigStore.instance().store(name="translate_settings", node=settings.TranslateSettings)
ConfigStore.instance().store(name="tune_settings", node=settings.TuneSettings)


def decoding_beam() -> DictConfig:
    """decoding=beam, the group's default: §6.1's search as decoding.PAPER, typed as Decoding, overridable."""
    node = OmegaConf.structured(PAPER)
    OmegaConf.set_readonly(node, False)  # Decoding is frozen
    return node


ConfigStore.instance().store(group="decoding", name="beam", node=decoding_beam())


@contextmanager
def hydra_on_conf() -> Iterator:
    """Hydra's global state on conf/ (inside a Hydra app, the app's own); yields its config loader."""
    if GlobalHydra.instance().is_initialized():
        yield GlobalHydra.instance().config_loader()
        return
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        yield GlobalHydra.instance().config_loader()


def compose(config_name: str = "train", overrides: Sequence[str] = ()) -> DictConfig:
    with hydra_on_conf():
        return hydra_compose(config_name, overrides=list(overrides))


def model_preset(name: str) -> dict:
    """conf/model/<name>.yaml as TransformerConfig's keyword arguments (no vocabulary)."""
    return OmegaConf.to_container(compose("train", [f"model={name}"]).model, resolve=True)
