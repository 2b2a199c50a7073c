"""The house: every module says what it is for in its first line, and README.md's "Where things are"
names every module and folder that exists (nothing needs an import map to be found)."""

import ast
import shlex
import subprocess

from conftest import ROOT

PACKAGE = ROOT / "src" / "transformer_mt"


def python_files() -> list:
    return sorted([*PACKAGE.rglob("*.py"), *(ROOT / "scripts").glob("*.py")])


def test_every_module_and_script_starts_with_a_docstring_that_says_what_it_is_for():
    for path in python_files():
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        assert docstring, f"{path.relative_to(ROOT)} has no docstring"
        first = docstring.splitlines()[0]
        assert len(first.split()) >= 4, f"{path.relative_to(ROOT)}: first line too thin: {first!r}"


def test_where_things_are_lists_every_folder_module_and_script():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Where things are", 1)[1].split("\n## ", 1)[0]
    for folder in ("conf/", "src/transformer_mt/", "data/", "training/", "tools/", "scripts/", "tests/", "docs/"):
        assert f"{folder}`" in section, folder
    for path in python_files():
        if path.name != "__init__.py":
            assert f"`{path.name}`" in section, f"{path.relative_to(ROOT)} is not in README.md's Where things are"
    package_map = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8")))
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            assert path.name in package_map or f"{path.parent.name}/" in package_map, path.name


def test_make_install_passes_a_torch_with_pip_options_as_separate_arguments():
    # The README's GPU install line: a quoted "$(TORCH)" made pip read one requirement "torch==... --index-url ..."
    torch_arg = "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
    dry = subprocess.run(["make", "-n", "install", f"TORCH={torch_arg}"], capture_output=True, text=True, cwd=ROOT)
    assert dry.returncode == 0, dry.stderr
    (line,) = [line for line in dry.stdout.splitlines() if "pip install torch" in line]
    assert shlex.split(line)[-3:] == ["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cu128"]
