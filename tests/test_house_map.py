"""CONTRIBUTING.md's "Map of the house" names every module that exists, and nothing that does not."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIRECTORY = re.compile(r"^- `([\w/]+/)`:")
MODULE = re.compile(r"^  - `(\w+)`:")
PACKAGES = ("commlib", "commlib_torch", "commlib_jax")


def _house_map() -> dict[str, set[str]]:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    section = text.split("## Map of the house", 1)[1].split("\n## ", 1)[0]
    listed: dict[str, set[str]] = {}
    directory = None
    for line in section.splitlines():
        if found := DIRECTORY.match(line):
            directory = found.group(1)
            assert directory not in listed, f"{directory} is listed twice"
            listed[directory] = set()
        elif (found := MODULE.match(line)) and directory is not None:
            assert found.group(1) not in listed[directory], f"{directory}{found.group(1)} is listed twice"
            listed[directory].add(found.group(1))
    return listed


def _modules(directory: Path) -> set[str]:
    return {path.stem for path in directory.glob("*.py") if path.stem != "__init__"}


def _packages() -> set[str]:
    return {
        f"{init.parent.relative_to(ROOT).as_posix()}/"
        for package in PACKAGES
        for init in (ROOT / package).rglob("__init__.py")
    }


def test_every_package_has_its_entry() -> None:
    assert _packages() <= set(_house_map())


def test_each_entry_lists_exactly_the_modules_there() -> None:
    for directory, listed in _house_map().items():
        assert (ROOT / directory).is_dir(), f"the map lists {directory}, which does not exist"
        assert listed == _modules(ROOT / directory), directory
