"""SkyPilot's task fields, read as ours before the task is validated (docs/migrating-from-skypilot.md).

A SkyPilot task file is nearly a cloudtrain one. What differs only in name is read as our
field, with a note (one line, shown on stderr by the commands that read the task):

- ``resources.cloud: aws``: ``resources.provider``;
- ``resources.infra: aws/us-east-1[/us-east-1a]`` (``*`` for any region): provider, region
  and zone;
- ``resources.disk_size``: ``resources.disk_size_gb`` (both in GB);
- ``name:`` with capitals, '_' or '.': kept as the job's name; the cluster's name is derived
  from it (``names.derive``);
- ``resources.cpus`` / ``resources.memory`` on local or ssh nodes: not checked (those are
  the machines the user has), which the note says;
- ``resources.image_id: docker:IMAGE``: ``container.image`` (docs/containers.md); SkyPilot's
  registry login through ``SKYPILOT_DOCKER_*`` in ``envs`` is not read (the values would
  travel to every node): the note names ``container.registry_auth``.

A field given twice with different values (``cloud: aws`` and ``provider: gcp``) is refused
naming both. ``resources.any_of`` / ``ordered`` (alternatives) are refused, naming what
cloudtrain has instead: ``accelerators: any:N`` (the planner ranks every GPU model) and
``cloudtrain cost`` on one task file per alternative.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping

from cloudtrain.errors import SpecError
from cloudtrain.names import derive, is_valid
from cloudtrain.yamlsrc import LocatedYaml

FREE = ("local", "ssh")
_ALTERNATIVES = ("any_of", "ordered")


class _Reader:
    """One task's translation: the data, the key lines, the notes and where each of
    provider/region/zone came from (for an error that names both fields)."""

    def __init__(self, located: LocatedYaml, source: str) -> None:
        self.located, self.source = located, source
        self.lines = dict(located.lines)
        self.notes: list[str] = []
        data = located.data
        self.data: dict[Any, Any] = dict(data)
        res = data.get("resources")
        self.res: dict[Any, Any] | None = dict(res) if isinstance(res, dict) else None
        self.origin: dict[str, str] = {}
        self.renamed: dict[str, str] = {}   # our dotted field -> the one the file wrote

    def line(self, *path: Any) -> int | None:
        return self.located.line_of(path)

    def error(self, key: str, message: str, hint: str) -> SpecError:
        return SpecError(message, hint=hint, field=f"resources.{key}",
                         line=self.line("resources", key), source=self.source)

    def put(self, ours: str, value: str, theirs: str) -> None:
        """``resources.<ours> = value``, read from SkyPilot's ``resources.<theirs>``: refused
        when the task already gives ours a different value."""
        assert self.res is not None
        have = self.res.get(ours)
        if have is not None and str(have) != value:
            given = self.origin.get(ours, f"resources.{ours}")
            raise self.error(theirs, f"says {ours} '{value}', but {given} says '{have}'",
                             f"Keep one of them: cloudtrain reads resources.{theirs} as "
                             f"resources.{ours}.")
        self.res[ours] = value
        self.origin.setdefault(ours, f"resources.{theirs}")
        if have is None:
            self.renamed.setdefault(f"resources.{ours}", f"resources.{theirs}")
        line = self.line("resources", theirs)
        if line is not None and ("resources", ours) not in self.lines:
            self.lines[("resources", ours)] = line

    def cloud(self) -> None:
        assert self.res is not None
        value = self.res.pop("cloud")
        if not isinstance(value, str) or not value.strip():
            raise self.error("cloud", "is not a provider name",
                             "Write the provider, e.g. 'cloud: aws' (or 'provider: aws').")
        name = value.strip().lower()
        self.put("provider", name, "cloud")
        self.notes.append(f"resources.cloud: read as resources.provider: {name} (SkyPilot's "
                          "name for it)")

    def infra(self) -> None:
        assert self.res is not None
        value = self.res.pop("infra")
        parts = value.strip().split("/") if isinstance(value, str) else []
        if not 1 <= len(parts) <= 3 or not all(p.strip() for p in parts) or parts[0] == "*":
            raise self.error("infra", f"'{str(value)[:60]}' is not PROVIDER[/REGION[/ZONE]]",
                             "Write e.g. 'infra: aws/us-east-1' or 'infra: gcp/us-central1/"
                             "us-central1-a' ('*' for any region), or give resources.provider, "
                             "region and zone.")
        said = []
        for ours, part in zip(("provider", "region", "zone"), parts):
            part = part.strip().lower() if ours == "provider" else part.strip()
            if part != "*":
                self.put(ours, part, "infra")
                said.append(f"{ours} {part}")
        self.notes.append(f"resources.infra: read as resources {', '.join(said)}")

    def disk_size(self) -> None:
        assert self.res is not None
        value = self.res.pop("disk_size")
        if "disk_size_gb" in self.res and self.res["disk_size_gb"] != value:
            raise self.error("disk_size", f"is {value!r}, but resources.disk_size_gb is "
                             f"{self.res['disk_size_gb']!r}", "Keep one of them.")
        self.res["disk_size_gb"] = value
        self.renamed["resources.disk_size_gb"] = "resources.disk_size"
        line = self.line("resources", "disk_size")
        if line is not None:
            self.lines.setdefault(("resources", "disk_size_gb"), line)
        self.notes.append("resources.disk_size: read as resources.disk_size_gb (GB)")

    def sizes(self) -> None:
        """cpus/memory on the machines the user has: said, not checked."""
        assert self.res is not None
        asked = [k for k in ("cpus", "memory") if self.res.get(k) is not None]
        provider = self.res.get("provider")
        if provider is None and self.res.get("accelerators") in (None, "", "none") \
                and not self.res.get("instance_type"):
            provider = "local"    # the task model's default
        if asked and provider in FREE:
            self.notes.append(f"resources.{'/'.join(asked)}: not checked on {provider} nodes "
                              "(they are the machines you have); the ranking uses them on clouds")
        elif asked and self.res.get("accelerators") in (None, "", "none") \
                and not self.res.get("instance_type"):
            raise self.error(asked[0], "on a cloud, cpus and memory choose among the catalog's "
                             "GPU offers, and this task asks for no GPU",
                             "Add resources.accelerators (e.g. A100:8, or any:1 for the cheapest "
                             "GPU), or name a CPU instance in resources.instance_type (e.g. "
                             "m6i.2xlarge on AWS).")

    def docker_image(self) -> None:
        """``image_id: docker:REF`` is our ``container.image: REF``."""
        assert self.res is not None
        ref = str(self.res.pop("image_id"))[len("docker:"):].strip()
        box = self.data.get("container")
        box = dict(box) if isinstance(box, dict) else {}
        if box.get("image") not in (None, ref):
            raise self.error("image_id", f"says docker:{ref}, but container.image says "
                             f"'{box['image']}'", "Keep one of them: cloudtrain reads "
                             "resources.image_id: docker:IMAGE as container.image.")
        box["image"] = ref
        self.data["container"] = box
        self.renamed.setdefault("container.image", "resources.image_id")
        line = self.line("resources", "image_id")
        if line is not None:
            self.lines.setdefault(("container", "image"), line)
        self.notes.append(f"resources.image_id: read as container.image: {ref} (setup and run "
                          "run inside it on every node)")
        envs = self.data.get("envs")
        if isinstance(envs, dict) and any(str(k).startswith("SKYPILOT_DOCKER_") for k in envs):
            self.notes.append("envs.SKYPILOT_DOCKER_*: not used to log in (their values would "
                              "be sent to every node); name the variables that hold the login "
                              "on this machine in container.registry_auth")

    def name(self) -> None:
        name = self.data.get("name")
        if isinstance(name, str) and not is_valid(name):
            try:
                cluster = derive(name)
            except Exception:  # noqa: BLE001 - the task model's own check names the field
                return
            self.notes.append(f"name: '{name}' is the job's name; the cluster is named "
                              f"'{cluster}' (cluster names are lowercase letters, digits and "
                              "'-'; -c NAME gives another)")

    def read(self) -> Read:
        if self.res is not None:
            for key in _ALTERNATIVES:
                if key in self.res:
                    raise self.error(
                        key, "alternatives (SkyPilot's any_of/ordered) are not supported",
                        "Give one set of resources. For any GPU model with N per node, write "
                        "'accelerators: any:N' (the planner ranks every model by price and "
                        "fit); to compare set-ups, run 'cloudtrain cost' on one task file per "
                        "alternative.")
            if "cloud" in self.res:
                self.cloud()
            if "infra" in self.res:
                self.infra()
            if "disk_size" in self.res:
                self.disk_size()
            if str(self.res.get("image_id", "")).startswith("docker:"):
                self.docker_image()
            self.sizes()
            self.data["resources"] = self.res
        self.name()
        return Read(LocatedYaml(self.data, self.lines), tuple(self.notes), dict(self.renamed))


@dataclass(frozen=True)
class Read:
    """A task file's data with SkyPilot's fields read as ours."""

    located: LocatedYaml
    notes: tuple[str, ...]
    """One line each, for stderr: what was read differently from how it is written."""
    renamed: dict[str, str] = field(default_factory=dict)
    """Our dotted field -> SkyPilot's, where the value came from SkyPilot's field."""


def translate(located: LocatedYaml, source: str) -> Read:
    """The task data with SkyPilot's fields read as ours, and the notes that say so (the
    same data, and no notes, for a task that uses none). SpecError (exit 2) for a field
    given twice with different values, a malformed ``infra`` or ``cloud``, and alternatives."""
    if not isinstance(located.data, dict):
        return Read(located, ())
    return _Reader(located, source).read()


def as_written(err: SpecError, renamed: Mapping[str, str]) -> SpecError:
    """``err`` naming the field as the file wrote it ('resources.cloud (read as
    resources.provider)') when its value came from a SkyPilot field; else ``err``."""
    theirs = renamed.get(err.field)
    if theirs is None:
        return err
    out = copy.copy(err)
    out.message = err.message.replace(f"field '{err.field}':",
                                      f"field '{theirs}' (read as {err.field}):", 1)
    out.field, out.args = theirs, (out.message,)
    return out
