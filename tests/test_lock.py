"""requirements.lock (`make lock`) against pyproject.toml: what `make install` puts in is a set pyproject admits,
every file hashed, torch left to TORCH=, and Lightning's compromised releases refused by both."""

from __future__ import annotations

import re

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from conftest import ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

# GHSA-w37p-236h-pfx3: these stole credentials on `import lightning`
COMPROMISED = {"lightning": ["2.6.2", "2.6.3"], "pytorch-lightning": ["2.6.2", "2.6.3"]}


def requirements() -> list[Requirement]:
    """pyproject's dependencies and the extras `make install` adds (dev, export)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    return [Requirement(line) for line in project["dependencies"] + extras["dev"] + extras["export"]]


def locked() -> dict[str, list[tuple[Version, list[str]]]]:
    """name -> [(version, its hashes)], one entry per Python/platform fork of the universal lock."""
    entries: dict[str, list[tuple[Version, list[str]]]] = {}
    for block in re.split(r"\n(?=\S)", (ROOT / "requirements.lock").read_text(encoding="utf-8")):
        head = re.match(r"([A-Za-z0-9_.\-]+)==(\S+?)(?: ;.*)? \\$", block.split("\n")[0])
        if head:
            hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})", block)
            entries.setdefault(canonicalize_name(head[1]), []).append((Version(head[2]), hashes))
    return entries


def test_the_lock_holds_every_requirement_within_its_range_each_file_hashed_and_no_torch():
    lock = locked()
    assert "torch" not in lock, "requirements.lock pins torch: `make install` takes it from TORCH= (CPU or CUDA)"
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        if name == "torch":
            continue
        assert name in lock, f"{requirement.name} is in pyproject.toml but not in requirements.lock: run `make lock`"
        for version, _ in lock[name]:
            assert requirement.specifier.contains(version, prereleases=True), (
                f"requirements.lock has {name}=={version}, outside pyproject.toml's {requirement}: run `make lock`"
            )
    for name, entries in lock.items():
        for version, hashes in entries:
            assert hashes, f"requirements.lock: {name}=={version} has no hash (make install checks every file's)"


@pytest.mark.parametrize("name", sorted(COMPROMISED))
def test_the_compromised_lightning_releases_are_refused_by_pyproject_and_absent_from_the_lock(name):
    """pip resolves `pip install -e .` against these specifiers: into an environment that holds lightning 2.6.3 it
    must replace it or refuse, never keep it."""
    (requirement,) = [r for r in requirements() if canonicalize_name(r.name) == name]
    for bad in COMPROMISED[name]:
        assert not requirement.specifier.contains(bad), f"pyproject.toml's {requirement} admits {name} {bad}"
        assert Version(bad) not in [version for version, _ in locked()[name]]
    assert requirement.specifier.contains("2.6.6") and requirement.specifier.contains("2.6.1")  # the rest stay
