"""A command line checked before Hydra makes a folder and torch loads; Hydra's job and decoding handed down."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from transformer_mt.configs import CONF_DIR, compose, hydra_on_conf
from transformer_mt.decoding import Decoding
from transformer_mt.errors import InputError, closest, exit_on_user_error, required
from transformer_mt.evaluation.tuned import decoding_for
from transformer_mt.files import RunFolder, atomic_write
from transformer_mt.launcher import Job

# Hydra's flags after which it answers by itself (help, --cfg, --info, shell completion) or reads another config.
HYDRA_ANSWERS = {"-h", "--help", "--hydra-help", "--version", "-c", "--cfg", "-i", "--info", "-sc",
                 "--shell-completion", "--experimental-rerun", "-cp", "--config-path", "-cn", "--config-name", "-cd",
                 "--config-dir"}  # fmt: skip
# OmegaConf's words for a value of the wrong type -> what the value must be
KINDS = {
    "Integer": "a whole number",
    "Float": "a number",
    "valid bool": "true or false",
    "is not Optional": "given (not null)",
    "is not a ListConfig": "a list, e.g. [a,b]",
}


def check_command_line(config_name: str, argv: Sequence[str]) -> DictConfig | None:
    """The config composed (a sweep's first job; each value checked with the others at their first), one line for a
    misspelled key or option (trainer.max_step=5, +trainer.max_step=5, experiment=bse), None where Hydra answers."""
    from hydra.core.override_parser.overrides_parser import OverridesParser  # noqa: PLC0415 (Hydra's public parser)
    from hydra.errors import HydraException  # noqa: PLC0415

    if any(arg.partition("=")[0] in HYDRA_ANSWERS for arg in argv):
        return None
    values = []  # per override, its values as plain overrides
    try:
        with hydra_on_conf() as config_loader:  # glob(*) lists a group's options
            parser = OverridesParser.create(config_loader=config_loader)
            for o in parser.parse_overrides([arg for arg in argv if not arg.startswith("-")]):
                if o.key_or_group.startswith("hydra") or (o.is_sweep_override() and not o.is_discrete_sweep()):
                    continue
                key, sweep = o.get_key_element(), o.is_sweep_override()
                values.append([f"{key}={v}" for v in o.sweep_string_iterator()] if sweep else [o.input_line])
    except HydraException:  # a syntax error: Hydra's own answer
        return None
    first = [v[0] for v in values]
    jobs = [first] + [first[:i] + [other] + first[i + 1 :] for i, v in enumerate(values) for other in v[1:]]
    plain = OverridesParser.create()
    return [check_job(config_name, plain.parse_overrides(job)) for job in jobs][0]


def check_job(config_name: str, overrides: list) -> DictConfig | None:
    from hydra.errors import ConfigCompositionException, MissingConfigException  # noqa: PLC0415
    from omegaconf.errors import ValidationError  # noqa: PLC0415

    try:
        cfg = compose(config_name, [o.input_line for o in overrides])
    except MissingConfigException as e:  # experiment=bse: conf/experiment/bse.yaml does not exist
        group, _, option = (e.missing_cfg_file or "").rpartition("/")
        if not any(o.key_or_group == group for o in overrides) or not e.options:  # not a choice on the command line
            return None
        match = closest(option, e.options)
        hint = f"did you mean {group}={match}? " if match else ""
        raise InputError(f"{group}={option}: no such option; {hint}(the options: {', '.join(e.options)})") from None
    except ConfigCompositionException as e:  # trainer.max_step=5: a key the config lacks; model.d_model=x: a type
        key = str(getattr(e.__cause__, "full_key", None)).split("[")[0]  # alphas[0]: the list alphas
        given = next((o for o in reversed(overrides) if o.key_or_group == key), None)  # the last one counts
        if given is None:
            return None
        if isinstance(e.__cause__, ValidationError):  # a value of another type than settings.py's
            said = str(e.__cause__).splitlines()[0]
            kind = next((kind for words, kind in KINDS.items() if words in said), said)
            raise InputError(f"{given.key_or_group}={given.get_value_element_as_str()}: must be {kind}") from None
        others = compose(config_name, [o.input_line for o in overrides if o is not given])
        raise InputError(misspelled(given, others)) from None
    for given in (o for o in overrides if o.is_add()):  # +trainer.max_step=5 composes, but nothing would read it
        if problem := misspelled(given, cfg, added=True):
            raise InputError(problem)
    return cfg


def misspelled(given, cfg: DictConfig, added: bool = False) -> str | None:
    """One line naming the closest key, or what there is; None: an added key unlike any (the user's own)."""
    key, value = given.key_or_group, given.get_value_element_as_str()
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    siblings = set(node) - {name} if isinstance(node, DictConfig) else set()
    if match := closest(name, siblings):
        group = isinstance(node[match], DictConfig)  # trainr=cpu: the group trainer
        return f"{key}: no such setting; did you mean {parent + '.' if parent else ''}{match}{('=' + value) * group}?"
    if added:
        return None
    listed = ", ".join(sorted(siblings))
    return f"{key}: no such setting (a new key takes a plus: +{key}={value}); {parent or 'the top level'} has {listed}"


def hydra_command(config_name: str, task: Callable[[DictConfig], object]) -> Callable[[], None]:
    """The entry point of make <config_name>: the command line checked before Hydra makes a folder, then `task` on
    the composed config as a Hydra task (run_task); a stop signal (Ctrl+C) anywhere: one line, 128 + it."""
    import hydra  # noqa: PLC0415

    @hydra.main(config_path=CONF_DIR, config_name=config_name, version_base="1.3")
    @functools.wraps(task)  # Hydra names the job (its log file) after the task's module
    def run(cfg: DictConfig) -> None:
        run_task(task, cfg)

    def main() -> None:
        exit_on_user_error(check_command_line, config_name, sys.argv[1:])
        exit_on_user_error(run)

    return main


def run_task(fn: Callable, *args):
    """fn(*args) as a Hydra task: a UserError removes a folder of Hydra's files only and fails a sweep's job quietly."""
    from hydra.core.hydra_config import HydraConfig  # noqa: PLC0415 (Hydra only where configs are composed)
    from hydra.errors import CompactHydraException  # noqa: PLC0415
    from hydra.types import RunMode  # noqa: PLC0415

    if not HydraConfig.initialized():
        return exit_on_user_error(fn, *args)
    hydra = HydraConfig.get()
    failed = (lambda: CompactHydraException("")) if hydra.mode == RunMode.MULTIRUN else None
    cleanup = RunFolder(hydra.runtime.output_dir).remove_if_empty
    return exit_on_user_error(fn, *args, cleanup=cleanup, failed=failed)


def hydra_job() -> Job:
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
        record=lambda cfg, code: write_record(cfg, code, hydra),
    )


def write_record(cfg: DictConfig, code: dict, hydra: DictConfig) -> None:
    """<run>/.hydra/{config,hydra,overrides}.yaml as Hydra writes them, and code.yaml (runtime.code_record), by the
    training once its start's checks passed (hydra.output_subdir=null): a refused start leaves a record as it was."""
    folder = Path(hydra.runtime.output_dir) / ".hydra"
    nodes = {"config": cfg, "hydra": OmegaConf.create({"hydra": hydra}), "overrides": hydra.overrides.task}
    nodes["code"] = OmegaConf.create(code)
    for name, node in nodes.items():
        with atomic_write(folder / f"{name}.yaml") as tmp:
            tmp.write_text(OmegaConf.to_yaml(node), encoding="utf-8")


def chosen_decoding(cfg: DictConfig, say: Callable[[str], None]) -> Decoding:
    """make tune's settings for this checkpoint, or conf/decoding's (tuned=false, decoding on the command line)."""
    from hydra.core.hydra_config import HydraConfig  # noqa: PLC0415

    given = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    configured = Decoding.of(OmegaConf.to_container(cfg.decoding, resolve=True))
    decoding_given = any(o.lstrip("+~").startswith("decoding") for o in given)
    return decoding_for(required(cfg, "ckpt"), configured, cfg.tuned, decoding_given, say)
