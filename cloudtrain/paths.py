"""Where things live: the user's state directory and the files shipped with the package."""

from __future__ import annotations

import os
from pathlib import Path


def home_path() -> Path:
    """Where cloudtrain's home is (``$CLOUDTRAIN_HOME``, or the platform's user data
    directory), without creating it."""
    env = os.environ.get("CLOUDTRAIN_HOME")
    if env:
        return Path(env).expanduser().absolute()  # a relative home (./.cloudtrain) must not move with cwd
    from platformdirs import user_data_dir

    return Path(user_data_dir("cloudtrain", appauthor=False))


def home() -> Path:
    """``$CLOUDTRAIN_HOME``, or the platform's user data directory; created (private)."""
    p = home_path()
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = p.stat()
    if st.st_mode & 0o077 and st.st_uid == os.getuid():
        p.chmod(0o700)  # it holds keys, state and logs: private, also when made by an older version
    return p


def private_dir(path: Path) -> Path:
    """``mkdir -p`` where every folder it creates is 0700 (pathlib gives missing parents 0755)."""
    missing = [d for d in [path, *path.parents] if not d.exists()]
    for d in reversed(missing):
        d.mkdir(mode=0o700, exist_ok=True)
    return path


def private_opener(path: str, flags: int) -> int:
    """``open(..., opener=private_opener)``: a new file is created 0600 (logs, state)."""
    return os.open(path, flags, 0o600)


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
