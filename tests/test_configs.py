"""The Hydra configs (conf/) and train.py's checks of them: every experiment and group composes, the paper's
values, unknown keys and settings that would fail late are refused first, in one line, leaving no run folder."""

import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import CONF, ROOT, run_process, run_train
from transformer_mt import commandline, launcher
from transformer_mt.commandline import check_command_line
from transformer_mt.configs import compose as compose_config
from transformer_mt.data.datamodule import TranslationDataModule
from transformer_mt.errors import InputError
from transformer_mt.files import RunFolder
from transformer_mt.launcher import check_device, gpu_may_be_visible
from transformer_mt.model import Transformer, TransformerConfig
from transformer_mt.training.callbacks import StartupLog
from transformer_mt.training.fit import check_config, make_callbacks, trainer_arguments

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def compose_train(overrides: list[str]):
    return compose_config("train", overrides)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_instantiates(experiment, tmp_path):
    cfg = compose_train([f"experiment={experiment}", f"data.cache_dir={tmp_path}"])
    with torch.device("meta"):
        model = Transformer(TransformerConfig(vocab_size=cfg.data.vocab_size, **cfg.model))
    layers, width = (len(model.encoder_layers), len(model.decoder_layers)), model.encoder_layers[0].ffn.w1.weight.shape
    assert layers == (cfg.model.n_encoder_layers, cfg.model.n_decoder_layers) and width == (
        cfg.model.d_ff,
        cfg.model.d_model,
    )
    datamodule = TranslationDataModule(**OmegaConf.to_container(cfg.data, resolve=True))
    assert datamodule.cache_dir == tmp_path and datamodule.tokens_per_update == cfg.data.tokens_per_update
    if cfg.trainer.accelerator == "gpu" and not torch.cuda.is_available():
        cfg.trainer.accelerator = "cpu"  # the same keys, checked on CPU
    callbacks = make_callbacks(cfg, tmp_path, StartupLog(0.0))
    trainer = L.Trainer(**trainer_arguments(cfg.trainer), logger=False, callbacks=callbacks)
    assert trainer.max_steps == cfg.trainer.max_steps and trainer.checkpoint_callback is not None


@pytest.mark.parametrize("group", ["data", "model", "trainer", "logger"])
def test_every_group_option_composes(group, tmp_path):
    for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
        extra = ["data.path=/somewhere"] if (group, option) == ("data", "text") else []
        cfg = compose_train([f"{group}={option}", *extra])
        assert cfg[group] is not None, option
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        slurm = compose("train", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
        optuna = compose("train", overrides=["hparams_search=optuna"], return_hydra_config=True)
    assert slurm.hydra.launcher.gpus_per_node == 8 and optuna.hydra.sweeper.direction == "maximize"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["trainer.max_step=5"], "trainer.max_step: no such setting; did you mean trainer.max_steps?"),
        (["+trainer.max_step=5"], "trainer.max_step: no such setting; did you mean trainer.max_steps?"),
        (["experiment=base", "data.max_tokns=5"], "data.max_tokns: no such setting; did you mean data.max_tokens?"),
        (["+data.max_tokns=5"], "data.max_tokns: no such setting; did you mean data.max_tokens?"),
        (["+model.d_modle=3"], "model.d_modle: no such setting; did you mean model.d_model?"),
        (["optim.warmup_step=3"], "optim.warmup_step: no such setting; did you mean optim.warmup_steps?"),
        (["checkpoint.kep_last=3"], "checkpoint.kep_last: no such setting; did you mean checkpoint.keep_last?"),
        (["+final.averge_last=2"], "final.averge_last: no such setting; did you mean final.average_last?"),
        (["seeed=1"], "seeed: no such setting; did you mean seed?"),
        (["trainr=cpu"], "trainr: no such setting; did you mean trainer=cpu?"),
        (["experiment=bse"], "experiment=bse: no such option; did you mean experiment=base? (the options: base, "),
        (["trainer.limit_val_batches=2"], "trainer.limit_val_batches: no such setting (a new key takes a plus: +trai"),
        (["trainer.foo=1"], "trainer.foo: no such setting (a new key takes a plus: +trainer.foo=1); trainer has accel"),
        # the README's own commands carry hydra.run.dir: the check does not step aside for a hydra.* override
        (["trainer.max_step=5", "hydra.run.dir=outputs/m30k"], "trainer.max_step: no such setting; did you mean "),
        (["hydra.run.dir=x", "+data.max_tokns=5"], "data.max_tokns: no such setting; did you mean data.max_tokens?"),
        # a sweep: Hydra composes every job before it runs one, so each is checked (glob() expanded too)
        (["-m", "experiment=table3", "table3=glob(*)", "trainer.max_step=5"], "trainer.max_step: no such setting; "),
        (["-m", "seed=1,2", "+data.max_tokns=5", "hydra.sweep.dir=x"], "data.max_tokns: no such setting; did you "),
        (["--multirun", "seed=1,2", "optim.warmup_step=1,2"], "optim.warmup_step: no such setting; did you mean "),
        (["-m", "experiment=base,bse"], "experiment=bse: no such option; did you mean experiment=base? (the options"),
        (["-m", "hparams_search=optuna", "optim.lr_factor=interval(0.5,2)", "seeed=1"], "seeed: no such setting; "),
    ],
)
def test_a_misspelled_key_in_any_group_is_refused_in_one_line_with_the_closest_key(argv, message):
    with pytest.raises(InputError) as error:
        check_command_line("train", argv)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)


def test_what_hydra_answers_itself_or_a_new_key_passes_the_command_line_check():
    assert check_command_line("train", ["+trainer.limit_val_batches=2", "+note=baseline"]).note == "baseline"
    for argv in (["--help"], ["--cfg", "job", "trainer.max_step=5"], ["seed=[1"], ["-cn", "evaluate", "seeed=1"]):
        assert check_command_line("train", argv) is None  # Hydra's own answer
    sweep = ["-m", "experiment=table3_cpu", "table3_cpu=glob(*)", "optim.lr_factor=interval(0.5,2)"]
    assert check_command_line("train", sweep).table3_row.name == "A-h1"  # the first job (an interval: drawn)
    # A new trainer key far from every configured one passes that check; Lightning's signature refuses it, by name.
    for added, message in [("max_step", "; did you mean trainer.max_steps?"), ("limit_val_batchs", "; did you mean ")]:
        with pytest.raises(InputError, match=rf"^trainer.{added}: not a lightning.Trainer argument{message}"):
            trainer_arguments(compose_train([f"+trainer.{added}=5"]).trainer)
    assert trainer_arguments(compose_train(["+trainer.limit_val_batches=2"]).trainer)["limit_val_batches"] == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_a_gpu_recipe_without_a_gpu_points_at_the_cpu_recipe():
    with pytest.raises(InputError) as error:
        check_device(compose_train(["experiment=base"]).trainer.accelerator)
    assert "make train CONFIG=multi30k" in str(error.value) and str(error.value).endswith("add trainer=cpu")


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, message",
    [
        (["+trainer.max_step=5"], "trainer.max_step: no such setting; did you mean trainer.max_steps?"),
        (["experiment=multi30k", "trainer.max_step=5"], "trainer.max_step: no such setting; did you mean trainer.max_"),
        (["-m", "seed=1,2", "trainer.max_step=5"], "trainer.max_step: no such setting; did you mean trainer.max_"),
        (["experiment=base"], "trainer.accelerator=gpu needs a CUDA GPU and none is visible here. On a CPU, train "),
    ],
)
def test_a_refused_start_is_one_line_before_torch_or_any_data_and_leaves_no_folder(argv, message, tmp_path):
    """The typo check costs Hydra's import, not torch's and Lightning's (~10 s on a 2-core machine, 50 s busy); so
    does the no-GPU refusal where no GPU driver is there (issue 43). No outputs/<date>/<time>/, no data cache."""
    if "experiment=base" in argv and gpu_may_be_visible():
        pytest.skip("a GPU driver is here: whether a GPU is visible takes torch to say")
    check = (
        "import sys\nfrom transformer_mt.train import main\n"
        f"sys.argv = ['train', *{argv!r}]\n"
        "try:\n    main()\nexcept SystemExit as e:\n"
        "    print(e.code, sorted(m for m in ('torch', 'lightning', 'transformers') if m in sys.modules))\n"
    )
    proc = run_process([sys.executable, "-c", check], tmp_path, env={"TRANSFORMER_MT_CACHE": str(tmp_path / "cache")})
    assert proc.stdout == "1 []\n", proc.stdout + proc.stderr[-2000:]
    assert proc.stderr.startswith(f"error: {message}") and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_gpu_is_known_absent_without_torch_when_no_driver_file_exists_or_cuda_visible_devices_hides_all(
    tmp_path, monkeypatch
):
    driver = tmp_path / "nvidiactl"
    monkeypatch.setattr(launcher, "GPU_DEVICE_FILES", (str(driver),))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert not gpu_may_be_visible()
    driver.touch()
    assert gpu_may_be_visible()
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert not gpu_may_be_visible()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert gpu_may_be_visible()


def test_base_and_big_carry_the_papers_values(tmp_path):
    base = compose_train(["experiment=base"])
    assert dict(base.model) == dict(
        d_model=512,
        d_ff=2048,
        n_heads=8,
        n_encoder_layers=6,
        n_decoder_layers=6,
        dropout=0.1,
        max_positions=1024,
        d_k=None,
        d_v=None,
        positions="sinusoidal",
        norm="post",
        share_embeddings="all",  # the switches: the paper's
    )
    assert base.label_smoothing == 0.1
    assert dict(base.optim) == dict(lr_factor=1.0, warmup_steps=4000, betas=[0.9, 0.98], eps=1e-9)
    assert base.trainer.max_steps == 100_000 and base.data.tokens_per_update == 25_000
    # a GPU's batch is the most it fits (the update stays 25k tokens); a CPU's is 4,096 tokens, big's 2,048
    assert (base.data.max_tokens, base.data.max_tokens_fallback) == ("auto", 4096)
    assert base.data.name == "wmt14" and base.data.vocab_size == 37_000
    assert base.checkpoint.train_time_interval_minutes == 10 and base.checkpoint.keep_last == 5
    assert base.logger._target_.endswith("WandbLogger")
    big = compose_train(["experiment=big"])
    assert (big.model.d_model, big.model.d_ff, big.model.n_heads, big.model.dropout) == (1024, 4096, 16, 0.3)
    assert big.trainer.max_steps == 300_000 and big.data.tokens_per_update == 25_000
    assert (big.data.max_tokens, big.data.max_tokens_fallback) == ("auto", 2048)
    assert big.checkpoint.keep_last == 20 and big.optim.warmup_steps == 4000
    # both end with §6.1's protocol: the last 5 / 20 checkpoints averaged, the test split (newstest2014) beam-decoded
    assert (base.final.enabled, base.final.average_last, list(base.final.splits)) == (True, 5, ["test"])
    assert (big.final.enabled, big.final.average_last) == (True, 20) and big.decoding.beam_size == 4


def test_settings_that_would_fail_late_are_refused_first(tmp_path):
    cfg = compose_train(["val_bleu_sentences=0"])
    with pytest.raises(InputError, match=r"best_monitor=val/bleu needs val_bleu_sentences > 0; or set checkpoint"):
        check_config(cfg)
    with pytest.raises(InputError, match="early_stopping_patience needs checkpoint.best_monitor"):
        check_config(compose_train(["early_stopping_patience=3", "checkpoint.best_monitor=null"]))
    # Wrong values, by key, before the data is built (not "TypeError: not all arguments converted")
    for override, message in [
        ("model.dropout=1.5", "model.dropout=1.5: must be in [0, 1)"),
        ("model.n_heads=3", "model.d_model=512 is not divisible by n_heads=3"),
        ("+model.d_modle=3", "model.d_modle: not a model setting; the model takes d_ff, d_k, d_model"),
        ("model.norm=sandwich", "model.norm='sandwich': must be one of post, pre"),
        ("model.d_k=0", "model.d_k=0: must be positive"),
        ("ema_decay=1.5", "ema_decay=1.5: must be a number in (0, 1)"),
        ("final.enabled=true final.splits=[dev]", "final.splits=['dev']: must be a list of validation and/or test"),
        ("optim.warmup_steps=-5", "optim.warmup_steps=-5: must be 0 or more"),
        ("trainer.val_check_interval=often", "trainer.val_check_interval='often': must be a number of updates"),
    ]:
        with pytest.raises(InputError) as error:
            check_config(compose_train(override.split()))
        assert str(error.value).startswith(message), (override, str(error.value))
    # Wrong types, as the command line is read (settings.py's types): one line, the config never composed
    for override, message in [
        ("model.d_model=abc", "model.d_model=abc: must be a whole number"),
        ("model.d_v=2.5", "model.d_v=2.5: must be a whole number"),
        ("optim.lr_factor=fast", "optim.lr_factor=fast: must be a number"),
        ("final.enabled=maybe", "final.enabled=maybe: must be true or false"),
        ("checkpoint.keep_last=null", "checkpoint.keep_last=null: must be given (not null)"),
        ("data.max_len=long", "data.max_len=long: must be a whole number"),
        ("decoding.alpha=high", "decoding.alpha=high: must be a number"),
        ("final.splits=test", "final.splits=test: must be a list, e.g. [a,b]"),
    ]:
        with pytest.raises(InputError) as error:
            check_command_line("train", [override])
        assert str(error.value) == message
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match=r"accelerator=gpu needs a CUDA GPU .* CONFIG=multi30k .* add trainer=cpu"):
            trainer_arguments(compose_train(["trainer=gpu"]).trainer)
    # the inference commands' keys, a list given one value, and the last of two overrides of a key
    for command, overrides, message in [
        ("tune", ["ckpt=x", "beams=4"], "beams=4: must be a list"),
        ("translate", ["ckpt=x", "ckpt=null"], "ckpt=null: must be given (not null)"),
    ]:
        with pytest.raises(InputError, match=re.escape(message)):
            check_command_line(command, overrides)
    # a null dict (data.text_files) still takes one from the command line
    files = compose_train(["data.path=/x", "data.text_files={train: a, validation: b, test: c}"]).data.text_files
    assert dict(files) == {"train": "a", "validation": "b", "test": "c"}


def test_cpu_precision_auto_is_bf16_only_where_the_cpu_computes_it(tmp_path, monkeypatch):
    cfg = compose_train(["trainer=cpu"]).trainer
    for native, expected in [(True, "bf16-mixed"), (False, "32-true")]:
        monkeypatch.setattr("transformer_mt.training.fit.cpu_has_native_bf16", lambda native=native: native)
        assert trainer_arguments(cfg)["precision"] == expected
    cfg.precision = "bf16-mixed"  # an explicit choice is kept
    assert trainer_arguments(cfg)["precision"] == "bf16-mixed"


@pytest.mark.slow
def test_a_failed_start_ends_in_one_line_and_leaves_no_run_folder(tmp_path):
    proc = run_train(["experiment=base", "data=wmt14", "data.path=/nonexistent/wmt14"], tmp_path, check=False)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "error: data 'wmt14': data.path=/nonexistent/wmt14 does not exist"
    ]
    assert not (tmp_path / "outputs").exists()  # Hydra's outputs/<date>/<time>/ is removed again


def test_a_failed_run_removes_only_its_own_hydra_only_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "outputs" / "2026-11-30" / "10-00-00"
    (run / ".hydra").mkdir(parents=True)
    (run / "train.log").write_text("started\n")
    keep = tmp_path / "outputs" / "2026-11-29" / "09-00-00" / "checkpoints"
    keep.mkdir(parents=True)
    RunFolder(run).remove_if_empty()
    assert not run.exists() and not run.parent.exists() and keep.exists()  # outputs/ still holds another run
    (tmp_path / ".hydra").mkdir()
    RunFolder(tmp_path).remove_if_empty()  # translate's run folder is "."
    assert (tmp_path / ".hydra").exists()
    done = tmp_path / "done"
    (done / "checkpoints").mkdir(parents=True)
    RunFolder(done).remove_if_empty()
    assert done.exists()


@pytest.mark.slow
@pytest.mark.timeout(900)  # pip builds the package
def test_installed_without_editable_mode_the_entry_points_find_their_configs(tmp_path):
    """`pip install .` (not -e) copies conf/ into the package; train, evaluate and translate compose from it,
    run as modules and as the console commands pip installs (the same entry points)."""
    source = tmp_path / "source"  # a copy, so that the build leaves nothing in the checkout
    shutil.copytree(
        ROOT / "src", source / "src", symlinks=True, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__")
    )
    shutil.copytree(ROOT / "conf", source / "conf")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(source)]
    subprocess.run(pip, check=True, capture_output=True, text=True, timeout=600)
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run(
        [sys.executable, "-c", "import transformer_mt; print(transformer_mt.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=tmp_path,
    ).stdout
    assert where.startswith(str(site)) and not (site / "transformer_mt" / "conf").is_symlink()
    for module, args, expected in [
        ("train", ["experiment=base"], "d_model: 512"),
        ("evaluate", ["ckpt=x.ckpt"], "beam_size: 4"),
        ("translate", ["ckpt=x.ckpt"], "batch_lines: 10000"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", f"transformer_mt.{module}", "--cfg", "job", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        assert proc.returncode == 0 and expected in proc.stdout, proc.stderr[-2000:]
        command = [str(site / "bin" / f"transformer-mt-{module}"), "--cfg", "job", *args]
        proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)
        assert proc.returncode == 0 and expected in proc.stdout, proc.stderr[-2000:]
    for command, expected in [("average", "usage: transformer-mt-average"), ("export", "usage: transformer-mt-export")]:
        proc = subprocess.run(
            [str(site / "bin" / f"transformer-mt-{command}"), "--help"], capture_output=True, text=True, env=env
        )
        assert proc.returncode == 0 and proc.stdout.startswith(expected), proc.stderr[-2000:]


@pytest.mark.slow
def test_hub_failure_says_how_to_work_offline(tmp_path):
    proc = run_train(
        ["experiment=multi30k", "data=multi30k", "trainer.max_steps=1"],
        tmp_path,
        check=False,
        env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and lines[-1].startswith("error: data 'multi30k': could not load bentrevett/multi30k")
    assert "(HF_HUB_OFFLINE is set). Offline, point data.path at a folder with its text files: " in lines[-1]
    assert "data.path=<folder with train.en, train.de, val.en" in lines[-1] and "make_wmt14" not in lines[-1]


def test_make_train_echoes_only_its_command_and_make_help_names_every_experiment():
    train = subprocess.run(
        ["make", "--no-print-directory", "-n", "train", "ARGS=seed=1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert train.stdout.splitlines() == [".venv/bin/python -m transformer_mt.train seed=1 experiment=multi30k"]
    help_text = subprocess.run(
        ["make", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    configs = next(line for line in help_text.splitlines() if line.startswith("CONFIG (make train):"))
    assert configs.split(":", 1)[1].split()[: len(EXPERIMENTS)] == EXPERIMENTS


def test_train_help_lists_every_experiment_and_keys_that_exist():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        help_text = compose("train", return_hydra_config=True).hydra.help.template
    listed = help_text.split("Experiments", 1)[1].split("Keys", 1)[0]
    assert sorted(line.split()[0] for line in listed.splitlines()[1:] if line.strip()) == EXPERIMENTS
    cfg = compose_train(["experiment=base"])
    for key in re.findall(r"\b([a-z_]+\.[a-z_.]+)=", help_text.split("Keys", 1)[1]):
        if not key.startswith("hydra."):
            parent, _, name = key.rpartition(".")
            assert name in OmegaConf.select(cfg, parent) or name in inspect.signature(L.Trainer).parameters, key


@pytest.mark.parametrize(
    "name, argv, message",
    [
        ("finish", ["run", "--devce", "cpu"], "unrecognized arguments: --devce cpu; did you mean --device?"),
        ("averaging", ["run", "--outptu", "a.ckpt"], "unrecognized arguments: --outptu a.ckpt; did you mean --output?"),
        (
            "averaging",
            ["run", "--last", "3"],
            "unrecognized arguments: --last 3 (the options: -h, --help, -n, -o, --out",
        ),
        (
            "tools.export",
            ["x.ckpt", "--formt", "hf", "--out", "o"],
            "unrecognized arguments: --formt hf; did you mean ",
        ),
        ("tools.export", ["x.ckpt", "--format", "hff", "--out", "o"], "argument --format: invalid choice: 'hff' (choo"),
        ("tools.attention_maps", ["x.ckpt", "--txt", "A"], "unrecognized arguments: --txt A; did you mean --text?"),
        ("tools.plot", ["run", "--ot", "a.png"], "unrecognized arguments: --ot a.png; did you mean --out?"),
        ("tools.table3", [], "the following arguments are required: runs (--help says more)"),
    ],
)
def test_the_option_commands_refuse_a_wrong_option_in_one_line_with_the_closest(
    name, argv, message, monkeypatch, capsys
):
    """make finish / average / export / attention / plot / table3 (and their console commands) take options, not
    Hydra keys: a misspelled one is one `error:` line naming the closest option, status 1, before any work."""
    module = importlib.import_module(f"transformer_mt.{name}")
    monkeypatch.setattr(sys, "argv", [name, *argv])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    error = capsys.readouterr().err
    assert exit_info.value.code == 1 and error.startswith(f"error: {message}") and error.count("\n") == 1, error


@pytest.mark.parametrize("form", ["key=value", "+key=value", "-m"])
@pytest.mark.parametrize(
    "name, typo, message",
    [
        ("evaluate", "decoding.beam=3", "error: decoding.beam: no such setting; did you mean decoding.beam_size?"),
        ("translate", "decoding.alpa=1", "error: decoding.alpa: no such setting; did you mean decoding.alpha?"),
        ("tune", "alphass=[1]", "error: alphass: no such setting; did you mean alphas?"),
    ],
)
def test_evaluate_translate_and_tune_refuse_a_misspelled_key_in_one_line_and_leave_no_folder(
    name, typo, message, form, tmp_path, monkeypatch, capsys
):
    """make evaluate / translate / tune and their console commands check the command line as make train does, with
    hydra.run.dir given too (the README's commands carry it), with a plus, or in a sweep: Hydra never starts."""
    module = importlib.import_module(f"transformer_mt.{name}")
    monkeypatch.setattr(commandline, "run_task", lambda *args: pytest.fail("Hydra ran the task"))
    argv = [f"ckpt={tmp_path / 'model.ckpt'}", "+" * (form == "+key=value") + typo, f"hydra.run.dir={tmp_path / 'x'}"]
    if form == "-m":
        argv = ["-m", *argv, "tokens_per_batch=1000,2000", f"hydra.sweep.dir={tmp_path / 'x'}"]
    monkeypatch.setattr(sys, "argv", [name, *argv])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 1 and capsys.readouterr().err.strip() == message
    assert not (tmp_path / "x").exists()
