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


def test_every_module_is_named_in_its_package_map():
    """Each package's __init__.py docstring is its map: it names every module beside it by file name."""
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            package_map = ast.get_docstring(ast.parse((path.parent / "__init__.py").read_text(encoding="utf-8")))
            assert f"{path.name}" in package_map, f"{path.relative_to(ROOT)} is not named in its package's map"


def test_no_module_over_420_lines_no_function_over_70_and_the_lightning_module_within_180():
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(ROOT)
        assert len(text.splitlines()) <= 420, f"{where}: {len(text.splitlines())} lines"
        for node in ast.walk(ast.parse(text)):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert size <= 70, f"{where}: {node.name} is {size} lines"
            if isinstance(node, ast.ClassDef) and node.name == "TranslationModule":
                assert size <= 180, f"{where}: {node.name} is {size} lines"


IMPORT_RULES = {  # module -> packages it must not import: the core never reaches into a wing or a front door
    "search.py": ("transformer_mt.data", "transformer_mt.training", "transformer_mt.tools"),
    "model.py": ("transformer_mt.data", "transformer_mt.training", "transformer_mt.tools"),
    "tools/table3.py": ("transformer_mt.training",),
}
# engines.py converts a checkpoint for CTranslate2 with tools/export.py only when asked (a deferred import): at its
# module level it must load nothing that loads torch (test_inference.py runs the import without torch).
TOP_LEVEL_RULES = {"engines.py": ("transformer_mt.tools", "transformer_mt.training", "transformer_mt.data")}


def imported_modules(path, top_level_only: bool = False) -> set[str]:
    names = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_imports_go_from_the_wings_and_front_doors_to_the_core_not_back():
    for name, forbidden in IMPORT_RULES.items():
        wrong = sorted(m for m in imported_modules(PACKAGE / name) if m.startswith(forbidden))
        assert not wrong, f"{name} imports {wrong}"
    for name, forbidden in TOP_LEVEL_RULES.items():
        wrong = sorted(m for m in imported_modules(PACKAGE / name, top_level_only=True) if m.startswith(forbidden))
        assert not wrong, f"{name} imports {wrong} at its module level"
    for path in (PACKAGE / "training").glob("*.py"):  # the averaging command is a front door; its core: checkpoint.py
        assert "transformer_mt.averaging" not in imported_modules(path), path.name


def test_make_install_passes_a_torch_with_pip_options_as_separate_arguments():
    # The README's GPU install line: a quoted "$(TORCH)" made pip read one requirement "torch==... --index-url ..."
    torch_arg = "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
    dry = subprocess.run(["make", "-n", "install", f"TORCH={torch_arg}"], capture_output=True, text=True, cwd=ROOT)
    assert dry.returncode == 0, dry.stderr
    (line,) = [line for line in dry.stdout.splitlines() if "pip install torch" in line]
    assert shlex.split(line)[-3:] == ["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cu128"]


def test_make_install_says_each_step_before_it_starts():
    # pip prints nothing while it unpacks torch: a person saw no sign of progress for minutes
    dry = subprocess.run(["make", "-n", "install"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    lines = dry.splitlines()
    steps = [i for i, line in enumerate(lines) if line.startswith('echo "make install [')]
    installs = [i for i, line in enumerate(lines) if " -m pip install " in line and "--upgrade pip" not in line]
    assert len(steps) == 3 and len(installs) == 2 and steps[1] < installs[0] < steps[2] < installs[1]
