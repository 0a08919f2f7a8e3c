"""Wheel build hook: ship bootstrap/ and templates/ as package data (cloudtrain/_data/...),
without what runs leave behind in a checkout (demo outputs, caches)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

TREES = ("bootstrap", "templates")
SKIP_PARTS = {"cloudtrain-outputs", "__pycache__", ".pytest_cache", "runs", "checkpoints"}
SKIP_SUFFIXES = {".pyc", ".pyo"}


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if version == "editable":
            return  # cloudtrain.paths finds the trees at the repository root
        root = Path(self.root)
        for tree in TREES:
            for path in sorted((root / tree).rglob("*")):
                rel = path.relative_to(root)
                if (path.is_file() and not SKIP_PARTS.intersection(rel.parts)
                        and path.suffix not in SKIP_SUFFIXES):
                    build_data["force_include"][str(path)] = f"cloudtrain/_data/{rel.as_posix()}"
