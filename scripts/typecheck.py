"""Type-check the mortal packages with mypy, as they install: `python scripts/typecheck.py [mypy args]`.

The four top-level folders become `mortal.*` only through pyproject's package-dir, which mypy cannot
read, and the editable install resolves them with an import hook mypy does not run. So this lays the
mapping out as a tree of links under build/typecheck (pyproject's [tool.mypy] mypy_path), runs mypy
with pyproject's settings, and prints its messages with the repository's own paths.
"""

from __future__ import annotations

import os
import shutil
import sys
import tomllib
from pathlib import Path

from mypy import api

REPO = Path(__file__).resolve().parents[1]
TREE = REPO / "build" / "typecheck"


def package_dirs() -> dict[str, str]:
    """pyproject's package-dir: dotted package -> folder of the repository."""
    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return settings["package-dir"]


def lay_out_tree(mapping: dict[str, str]) -> dict[str, str]:
    """Links under TREE that give every mapped package its dotted place; returns tree path -> repo path."""
    shutil.rmtree(TREE, ignore_errors=True)
    shown: dict[str, str] = {}
    for package, folder in sorted(mapping.items()):
        place = TREE.joinpath(*package.split("."))
        source = REPO / folder
        if any(other.startswith(f"{package}.") for other in mapping):  # others sit inside: link its entries
            place.mkdir(parents=True, exist_ok=True)
            for entry in source.iterdir():
                if entry.name != "__pycache__" and not (place / entry.name).exists():
                    (place / entry.name).symlink_to(entry)
        else:
            place.parent.mkdir(parents=True, exist_ok=True)
            place.symlink_to(source, target_is_directory=True)
        shown[f"{place.relative_to(REPO)}/"] = f"{folder}/"
    return shown


def main(argv: list[str]) -> int:
    os.chdir(REPO)  # pyproject's paths (cache, excludes) and the messages' paths are the repository's
    shown = lay_out_tree(package_dirs())
    out, err, status = api.run(["--config-file", str(REPO / "pyproject.toml"), *argv])
    for tree_path, repo_path in sorted(shown.items(), key=lambda item: -len(item[0])):
        out = out.replace(tree_path, repo_path)
    sys.stdout.write(out)
    sys.stderr.write(err)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
