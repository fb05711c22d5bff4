"""The release is tag-ready: the version pyproject.toml gives is the one installed and the
newest entry of the changelog, which has its date."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import tomllib

from conftest import TESTS

ROOT = pathlib.Path(TESTS).parent


def project_version() -> str:
    with open(ROOT / "pyproject.toml", "rb") as file:
        return str(tomllib.load(file)["project"]["version"])


def test_the_installed_version_is_the_projects() -> None:
    assert importlib.metadata.version("lockmgr") == project_version()


def test_the_newest_changelog_entry_is_this_version_with_its_date() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    newest = re.search(r"^## \[(?P<version>[^\]]+)\](?: - (?P<date>.+))?$", changelog,
                       re.MULTILINE)
    assert newest is not None, "the changelog has no release entry"
    assert newest["version"] == project_version()
    assert newest["date"] is not None and re.fullmatch(r"\d{4}-\d{2}-\d{2}", newest["date"]), (
        f"the {newest['version']} entry has no release date: {newest['date']!r}")
