"""Where things live: the user's state directory and the files shipped with the package."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """``$CLOUDTRAIN_HOME``, or the platform's user data directory."""
    env = os.environ.get("CLOUDTRAIN_HOME")
    if env:
        p = Path(env).expanduser()
    else:
        from platformdirs import user_data_dir

        p = Path(user_data_dir("cloudtrain", appauthor=False))
    p.mkdir(parents=True, exist_ok=True)
    return p


def _data_root(name: str) -> Path:
    """``bootstrap/`` and ``templates/`` ship in the wheel under ``cloudtrain/_data``; in an
    editable install (or a source checkout) they sit at the repository root."""
    pkg = Path(__file__).resolve().parent
    for cand in (pkg / "_data" / name, pkg.parent / name):
        if cand.is_dir():
            return cand
    raise FileNotFoundError(
        f"cloudtrain's '{name}' files are missing from this installation ({pkg}); reinstall cloudtrain."
    )


def bootstrap_dir() -> Path:
    return _data_root("bootstrap")


def templates_dir() -> Path:
    return _data_root("templates")
