"""The command line of an entry point, checked before torch and Lightning are imported (a misspelled key or
option is one line within a second or two, not after ~10 s of imports): the closest name for a typo,
lightning.Trainer's arguments read from its source, a GPU recipe refused on a machine without one."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import itertools
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from difflib import get_close_matches
from pathlib import Path
from typing import NoReturn

from omegaconf import DictConfig, OmegaConf

from transformer_mt.configs import compose, hydra_on_conf
from transformer_mt.decoding import Decoding
from transformer_mt.errors import InputError, exit_on_user_error, required
from transformer_mt.evaluation.tuned import decoding_for
from transformer_mt.files import RunFolder
from transformer_mt.launcher import Job


def trainer_parameters() -> set[str]:
    """What conf/trainer may hold: lightning.Trainer's arguments, read from Lightning's source without importing
    it (8 s on a 2-core machine), and compile (the module's)."""
    spec = importlib.util.find_spec("lightning")  # a top-level package is found, not imported
    source = Path(spec.submodule_search_locations[0]) / "pytorch" / "trainer" / "trainer.py"
    tree = ast.parse(source.read_text(encoding="utf-8"))
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    init = next(n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {a.arg for a in init.args.args + init.args.kwonlyargs} - {"self"} | {"compile"}


# Without one of these a CUDA GPU cannot be reached (NVIDIA's driver, or ROCm's for a ROCm build of torch).
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")


def gpu_may_be_visible() -> bool:
    """False where no CUDA GPU can be visible, known without importing torch (several seconds on a slow machine):
    no GPU driver's device file, or CUDA_VISIBLE_DEVICES set to hide every GPU."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1")
    return not hidden and any(Path(p).exists() for p in GPU_DEVICE_FILES)


def check_device(accelerator: str) -> None:
    """A GPU recipe on a machine without one is refused, pointing a CPU user at the recipe made for a CPU: before
    torch is imported where no GPU driver is there (gpu_may_be_visible), else as torch says."""
    if accelerator not in ("gpu", "cuda"):
        return
    if "torch" in sys.modules or gpu_may_be_visible():  # torch loaded already: it says (the shortcut saves its import)
        import torch  # noqa: PLC0415 (only a GPU recipe on a machine with a GPU driver asks)

        if torch.cuda.is_available():
            return
    raise InputError(
        f"trainer.accelerator={accelerator} needs a CUDA GPU and none is visible here. On a CPU, train the "
        'Multi30k recipe (~26 minutes on 2 cores): make train CONFIG=multi30k [ARGS="data.path=<folder with '
        'train.en, train.de, ...>"]; only to force this config onto the CPU (days for base) add trainer=cpu'
    )


def check_command_line(
    config_name: str, argv: Sequence[str], addable: dict[str, set[str]] | None = None
) -> DictConfig | None:
    """The config an entry point's command line composes, checked before Hydra starts a run (no run folder yet).
    A misspelled key or group option (trainer.max_step=5, +trainer.max_step=5, experiment=bse) is refused in one
    line with the closest name: Hydra's own answer is several lines, and its `+key=` hint turns a typo into a
    Trainer's TypeError. A `+key` is a typo when it is close to an existing key, or when its section is read by a
    signature (addable, e.g. trainer: lightning.Trainer's arguments) that does not take it. In a sweep (-m) every
    job is checked (sweep_jobs), and the first job's config returned. None where Hydra answers itself: --help,
    --info, --cfg, another config, a syntax error. hydra.* overrides are left out."""
    from hydra._internal.utils import get_args_parser  # noqa: PLC0415 (Hydra only where configs are composed)
    from hydra.errors import HydraException  # noqa: PLC0415

    args, _ = get_args_parser().parse_known_args(list(argv))
    if any(vars(args)[k] for k in ("help", "hydra_help", "info", "cfg", "shell_completion", "experimental_rerun")):
        return None
    if args.config_path or args.config_name or args.config_dir:
        return None
    try:
        jobs = sweep_jobs(args.overrides)
    except HydraException:
        return None
    checked = [check_job(config_name, job, addable or {}) for job in jobs]
    return checked[0]


MAX_SWEEP_JOBS = 64  # past this many jobs, each swept value is checked once rather than every combination


def sweep_jobs(overrides: Sequence[str]) -> list[list]:
    """The jobs of a command line as Hydra's basic sweeper makes them (a,b, range(), choice() and glob() expanded;
    one job where nothing sweeps), each a list of plain overrides, hydra.* left out. Hydra composes every job of a
    sweep before it runs any, so a key wrong in one job stops them all: up to MAX_SWEEP_JOBS every job is checked,
    past that each swept value once (the other sweeps at their first). A sweep that is not a list of values (an
    Optuna interval()) is left out: the sweeper draws its values."""
    from hydra.core.override_parser.overrides_parser import OverridesParser  # noqa: PLC0415
    from hydra.core.override_parser.types import Override  # noqa: PLC0415

    with hydra_on_conf() as config_loader:  # glob(*) lists a group's options
        parsed = OverridesParser.create(config_loader=config_loader).parse_overrides(list(overrides))
        kept = [o for o in parsed if not o.key_or_group.startswith("hydra")]
        kept = [o for o in kept if o.is_discrete_sweep() or not o.is_sweep_override()]
        key = Override.get_key_element
        values = [
            [f"{key(o)}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [o.input_line]
            for o in kept
        ]
    if math.prod(map(len, values)) <= MAX_SWEEP_JOBS:
        jobs = list(itertools.product(*values))
    else:
        first = [v[0] for v in values]
        jobs = [first] + [first[:i] + [other] + first[i + 1 :] for i, v in enumerate(values) for other in v[1:]]
    plain = OverridesParser.create()
    return [plain.parse_overrides(list(job)) for job in jobs]


def check_job(config_name: str, kept: list, addable: dict[str, set[str]]) -> DictConfig | None:
    """One job's overrides (no sweep, no hydra.*) composed, or refused in one line (check_command_line)."""
    from hydra.errors import ConfigCompositionException, MissingConfigException  # noqa: PLC0415

    try:
        cfg = compose(config_name, [o.input_line for o in kept])
    except MissingConfigException as e:  # experiment=bse: conf/experiment/bse.yaml does not exist
        group, _, option = (e.missing_cfg_file or "").rpartition("/")
        if not any(o.key_or_group == group for o in kept) or not e.options:  # not a choice on the command line
            return None
        match = closest(option, e.options)
        hint = f"did you mean {group}={match}? " if match else ""
        raise InputError(f"{group}={option}: no such option; {hint}(the options: {', '.join(e.options)})") from None
    except ConfigCompositionException as e:  # trainer.max_step=5: a key the config does not have
        key = getattr(e.__cause__, "full_key", None)
        given = next((o for o in kept if o.key_or_group == key), None)
        if given is None:
            return None
        others = compose(config_name, [o.input_line for o in kept if o is not given])
        raise InputError(unknown_key(key, others, given.get_value_element_as_str(), addable)) from None
    for given in (o for o in kept if o.is_add()):  # +trainer.max_step=5: composes, but nothing reads it
        parent, _, name = given.key_or_group.rpartition(".")
        if name in addable.get(parent, ()):  # +trainer.limit_val_batches=2: a Trainer argument
            continue
        problem = unknown_key(given.key_or_group, cfg, given.get_value_element_as_str(), addable)
        if problem and (parent in addable or "did you mean" in problem):  # else a new key: the user's own
            raise InputError(problem)
    return cfg


def unknown_key(key: str, cfg: DictConfig, value: str, addable: dict[str, set[str]]) -> str | None:
    """One line for a key that is not in cfg, beside it: the closest existing key, or what there is (None: cfg has
    it). addable: per section, the keys its reader also takes (a Trainer argument conf/trainer does not list)."""
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    siblings = set(node) - {name} if isinstance(node, DictConfig) else set()
    known = siblings | addable.get(parent, set())
    if name in known:
        return None if name in siblings else f"{key} is not in the config; add it with a plus: +{key}={value}"
    match = closest(name, known)
    if match is None:
        return f"{key}: no such setting; {parent or 'the top level'} has {', '.join(sorted(known))}"
    group = match in siblings and isinstance(node[match], DictConfig)  # trainr=cpu: the group trainer
    return f"{key}: no such setting; did you mean {parent + '.' if parent else ''}{match}{('=' + value) * group}?"


def closest(name: str, options: Iterable[str]) -> str | None:
    """The option closest to a misspelled name, if one is close (difflib's ratio >= 0.6)."""
    match = get_close_matches(name, list(options), n=1)
    return match[0] if match else None


def checked_main(config_name: str, run: Callable[[], None]) -> None:
    """An entry point whose command line is checked (check_command_line) before Hydra runs it: a misspelled key
    is one line, and no run folder is made."""
    exit_on_user_error(check_command_line, config_name, sys.argv[1:])
    run()


def run_task(fn: Callable, *args):
    """fn(*args) as a Hydra task (errors.exit_on_user_error): on a UserError the run folder Hydra made is removed if
    it holds nothing but Hydra's own files, and in a sweep the job fails after its line with an exception that
    Hydra reports without a traceback: Hydra records the failed job, the other jobs still run, and the sweep ends
    with Hydra's one-line summary ("Error executing job with overrides: ...") and status 1."""
    from hydra.core.hydra_config import HydraConfig  # noqa: PLC0415 (Hydra only where configs are composed)
    from hydra.errors import CompactHydraException  # noqa: PLC0415
    from hydra.types import RunMode  # noqa: PLC0415

    if not HydraConfig.initialized():
        return exit_on_user_error(fn, *args)
    hydra = HydraConfig.get()
    sweep = hydra.mode == RunMode.MULTIRUN  # Hydra prints a CompactHydraException as its text alone: here none
    failed = (lambda: CompactHydraException("")) if sweep else None
    return exit_on_user_error(
        fn, *args, cleanup=RunFolder(Path(hydra.runtime.output_dir)).remove_if_empty, failed=failed
    )


def hydra_job() -> Job:
    """The running Hydra job as launcher.Job: what a training needs to know of Hydra, handed down by train.py."""
    from hydra.core.hydra_config import HydraConfig  # noqa: PLC0415
    from hydra.types import RunMode  # noqa: PLC0415
    from hydra.utils import instantiate  # noqa: PLC0415

    hydra = HydraConfig.get()
    sweep = hydra.mode == RunMode.MULTIRUN
    return Job(
        run_dir=Path(hydra.runtime.output_dir),
        overrides=tuple(hydra.overrides.task),
        sweep_dir=hydra.sweep.dir if sweep else None,
        number=hydra.job.num if sweep else None,
        instantiate=instantiate,
    )


def chosen_decoding(cfg: DictConfig, say: Callable[[str], None]) -> Decoding:
    """What make translate / make evaluate decode with: conf/decoding's settings, or make tune's for this
    checkpoint unless tuned=false or the command line sets decoding or a decoding.* key (evaluation/tuned.py)."""
    from hydra.core.hydra_config import HydraConfig  # noqa: PLC0415

    given = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    configured = Decoding.of(OmegaConf.to_container(cfg.decoding, resolve=True))
    decoding_given = any(o.lstrip("+~").startswith("decoding") for o in given)
    return decoding_for(required(cfg, "ckpt"), configured, cfg.tuned, decoding_given, say)


class CommandParser(argparse.ArgumentParser):
    """argparse for the commands that take options rather than Hydra keys (make finish, average, export, attention,
    plot, table3): a wrong option is one `error:` line with the closest option and exit status 1, as a misspelled
    key is for the Hydra commands (argparse's own answer: its usage, then the error, exit status 2)."""

    def __init__(self, doc: str | None):
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message: str) -> NoReturn:
        options = [option for action in self._actions for option in action.option_strings]
        given = message.partition("unrecognized arguments: ")[2].split()
        hints = [f"did you mean {match}?" for g in given if g.startswith("-") and (match := closest(g, options))]
        listed = f" (the options: {', '.join(options)})" if given and not hints else " (--help says more)"
        raise InputError("; ".join([message, *hints]) + listed)

    def parse(self) -> argparse.Namespace:
        """The command line's options, or one `error:` line and exit status 1."""
        return exit_on_user_error(self.parse_args)
