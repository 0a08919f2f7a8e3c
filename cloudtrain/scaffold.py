"""``cloudtrain init``: copy the training template (script, example tasks, requirements) into
a project folder, never overwriting what the user already has there."""

from __future__ import annotations

import shutil
from pathlib import Path

from cloudtrain.errors import UserError
from cloudtrain.paths import templates_dir

TEMPLATE = "train"
# What runs leave behind in a checkout of the template: never scaffolded.
_SKIP = {"__pycache__", "cloudtrain-outputs", "outputs", ".pytest_cache"}


def template_files() -> list[Path]:
    root = templates_dir() / TEMPLATE
    return sorted(p.relative_to(root) for p in root.rglob("*")
                  if p.is_file() and not _SKIP.intersection(p.relative_to(root).parts))


def scaffold(dest: Path, force: bool = False) -> list[Path]:
    """Copy the template into ``dest``; return the files written. Refuses (changing nothing)
    when a file would be overwritten, unless ``force``."""
    if dest.exists() and not dest.is_dir():
        raise UserError(f"'{dest}' exists and is not a folder.",
                        "Give a folder to create the project in, e.g. cloudtrain init my-project")
    root = templates_dir() / TEMPLATE
    files = template_files()
    clash = [rel for rel in files if (dest / rel).exists()]
    if clash and not force:
        raise UserError(
            f"'{dest}' already has {', '.join(str(c) for c in clash)}: nothing was written.",
            "Pick an empty folder (cloudtrain init NEW-DIR), or pass --force to overwrite them.")
    written = []
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
        written.append(target)
    return written
