"""README.md's promises that code can check: its Python example runs as written after the README's own steps."""

import re
import shutil

import pytest

from conftest import ROOT


def readme_python_example() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return readme.split("<!-- python example -->\n```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_readmes_python_example_runs_on_the_checkpoint_its_multi30k_command_writes(
    trained_run, tmp_path, monkeypatch, capsys
):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = next(line for line in readme.splitlines() if "make train CONFIG=multi30k ARGS=" in line)
    run_dir = re.search(r"hydra\.run\.dir=(\S+?)[\"`\s]", command).group(1)
    code = readme_python_example()
    ckpt = re.search(r'load_for_inference\("([^"]+)"\)', code).group(1)
    assert ckpt.startswith(run_dir + "/checkpoints/"), (command, ckpt)  # the file the README's run writes
    # The Multi30k recipe's end of run averages the last 5 checkpoints into this name (final.average_last: 5);
    # here, the session's tiny trained run stands in for that run, its weights under the README's path.
    (tmp_path / ckpt).parent.mkdir(parents=True)
    shutil.copy(trained_run / "out" / "checkpoints" / "last.ckpt", tmp_path / ckpt)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.startswith("[") and printed.count("'") >= 4, printed  # two translations, as a list of strings
