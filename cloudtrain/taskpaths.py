"""The rules every path written in a task file follows (lengths, and where a file_mounts target
may point), as ValueErrors the task model turns into field errors (``taskmodel``)."""

from __future__ import annotations

MAX_PATH = 4096                 # a path in the task (bytes, as Linux's PATH_MAX)
MAX_PATH_PART = 255             # one component of it (NAME_MAX)


def check_path_text(p: str) -> None:
    """Length rules every path in a task follows (NUL is refused by the reader)."""
    size = len(p.encode("utf-8", "surrogatepass"))
    if size > MAX_PATH:
        raise ValueError(f"the path is {size} bytes long; paths are at most {MAX_PATH}")
    long_part = next((part for part in p.split("/")
                      if len(part.encode("utf-8", "surrogatepass")) > MAX_PATH_PART), None)
    if long_part is not None:
        raise ValueError(f"the path has a name longer than {MAX_PATH_PART} bytes "
                         f"('{long_part[:20]}...')")
    if not p.strip():
        raise ValueError("the path is empty")


def check_mount_target(target: str) -> None:
    """A file_mounts target (the path on the node): relative ones are under the node's
    workdir, absolute ones are paths on the node's own disk (refused where nodes share this
    machine, see check_mounts). Neither may climb with '..' or start with '~'."""
    check_path_text(target)
    parts = target.split("/")
    if ".." in parts:
        raise ValueError(f"the node path '{target}' climbs out with '..'; write it relative to "
                         "the workdir without '..' (e.g. 'data') or as an absolute path")
    if target.startswith("~"):
        raise ValueError(f"the node path '{target}' starts with '~'; write it relative to the "
                         "workdir (e.g. 'data') or as an absolute path")
    if not target.startswith("/") and all(part in ("", ".") for part in parts):
        raise ValueError(f"the node path '{target}' is the workdir itself; name a file or "
                         "directory under it (e.g. 'data')")
