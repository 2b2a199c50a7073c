"""Where the Hydra configs live (transformer_mt/conf: a link to the checkout's conf/, a copy once
installed), and composing them outside an entry point (scripts, tests) exactly as Hydra does."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from transformer_mt.decoding import PAPER, TUNE_GRID
from transformer_mt.launcher import launch_id

CONF_DIR = str(Path(__file__).resolve().parent / "conf")


def run_folder() -> str:
    """${run_folder:} in conf/train.yaml's hydra.run.dir: <date>/<time>, or under torchrun/srun the job's
    name (launch_id), the same for every rank and for the job requeued or restarted: one run folder."""
    return launch_id() or datetime.now().strftime("%Y-%m-%d/%H-%M-%S")


def own_folder() -> str:
    """${own_folder:} in make evaluate's and make tune's hydra.run.dir: <date>_<time>-<process id>, so that two
    commands started in the same second write to folders of their own."""
    return f"{datetime.now():%Y-%m-%d_%H-%M-%S}-{os.getpid()}"


OmegaConf.register_new_resolver("run_folder", run_folder, replace=True)
OmegaConf.register_new_resolver("own_folder", own_folder, replace=True)
# ${tune_grid:alphas} in conf/tune.yaml and conf/train.yaml's final block: make tune's grid, decoding.TUNE_GRID
OmegaConf.register_new_resolver("tune_grid", lambda key: list(TUNE_GRID[key]), replace=True)


def store_paper_decoding() -> None:
    """decoding=beam, the config group's default: §6.1's beam search (beam 4, length penalty alpha 0.6, output length
    at most input + 50), decoding.PAPER's settings, where they are written once; conf/decoding/greedy.yaml builds
    on it. Stored in Hydra's ConfigStore as plain values (overridable: decoding.alpha=1.0)."""
    from hydra.core.config_store import ConfigStore  # noqa: PLC0415 (Hydra only where configs are composed)

    ConfigStore.instance().store(group="decoding", name="beam", node=PAPER.settings())


store_paper_decoding()


@contextmanager
def hydra_on_conf() -> Iterator:
    """Hydra's global state on conf/, which composing and glob() need; inside a Hydra app, the app's own (its
    search path is already this one). Yields Hydra's config loader."""
    from hydra import initialize_config_dir  # noqa: PLC0415 (Hydra only where configs are composed)
    from hydra.core.global_hydra import GlobalHydra  # noqa: PLC0415

    if GlobalHydra.instance().is_initialized():
        yield GlobalHydra.instance().config_loader()
        return
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        yield GlobalHydra.instance().config_loader()


def compose(config_name: str = "train", overrides: Sequence[str] = ()) -> DictConfig:
    """A primary config (train, evaluate, translate) with command-line style overrides."""
    from hydra import compose as hydra_compose  # noqa: PLC0415 (Hydra only where configs are composed)

    with hydra_on_conf():
        return hydra_compose(config_name, overrides=list(overrides))


def model_preset(name: str) -> dict:
    """conf/model/<name>.yaml (small, base, big) as TransformerConfig's keyword arguments (no vocabulary)."""
    return OmegaConf.to_container(compose("train", [f"model={name}"]).model, resolve=True)
