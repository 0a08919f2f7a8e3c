"""YAML loading that remembers where each key came from, so errors can name the line.

A task file comes from anywhere (a colleague, a generator, a pasted snippet), so the reader
bounds what it builds and fails *before* building it: the file's size, its nesting depth, its
number of aliases and the number of values once every alias is expanded (an "alias bomb" of a
few hundred bytes otherwise expands to gigabytes). Every failure, including values the YAML
constructor cannot build (``!!int abc``, ``2001-13-45``, unknown ``!tags``), is a
:class:`~cloudtrain.errors.SpecError` that names the line: never a traceback.
"""

from __future__ import annotations

from typing import Any

import yaml

from cloudtrain.errors import SpecError

Path_ = tuple[object, ...]

MAX_BYTES = 256 * 1024
"""Largest task file read (a real one is a few kB; scripts longer than this belong in files)."""
MAX_DEPTH = 32
"""Deepest nesting of mappings/lists, counted after aliases are expanded."""
MAX_ALIASES = 100
"""Most alias references (``*name``) in one file."""
MAX_NODES = 20_000
"""Most values (keys, scalars, lists, mappings) once every alias is expanded."""

_STANDARD_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null",
                                                        "map", "seq")}
_MERGE_TAG = "tag:yaml.org,2002:merge"
_QUOTE_HINT = "Quote the value to make it text (e.g. 'abc'), or write a plain value without a tag."


class LocatedYaml:
    """Plain Python data plus a map from a key path to the 1-based line it sits on."""

    def __init__(self, data: Any, lines: dict[Path_, int]) -> None:
        self.data = data
        self.lines = lines

    def __eq__(self, other: object) -> bool:
        # Tasks keep their LocatedYaml privately; two parses of the same text compare equal.
        if not isinstance(other, LocatedYaml):
            return NotImplemented
        return (self.data, self.lines) == (other.data, other.lines)

    __hash__ = None  # type: ignore[assignment]  # unhashable: equal by value, and mutable

    def line_of(self, path: Path_) -> int | None:
        path = tuple(path)
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return None


class _BoundedLoader(yaml.SafeLoader):
    """The safe loader's composer with limits checked while the node graph is composed, before
    anything is expanded: nesting depth (checked on the way down, so a 10 000-level file never
    recurses), aliases (count, and an alias to a mapping/list that is still open is a cycle),
    and the expanded size and depth of each finished node (aliases share their node, so the
    sizes are summed, not expanded)."""

    def __init__(self, text: str, source: str) -> None:
        super().__init__(text)
        self._source = source
        self._open_depth = 0
        self._open_anchors: set[str] = set()
        self._aliases = 0
        # id(node) -> (values once expanded, nesting depth once expanded)
        self._size: dict[int, tuple[int, int]] = {}

    def resolve(self, kind: Any, value: Any, implicit: Any) -> str:
        # An unquoted date (2024-01-01) is text here, as every task field wants it; only an
        # explicit '!!timestamp' asks for a date, and that tag is refused in _build.
        tag = super().resolve(kind, value, implicit)
        return "tag:yaml.org,2002:str" if tag == "tag:yaml.org,2002:timestamp" else tag

    def _fail(self, message: str, mark: Any, hint: str) -> SpecError:
        return SpecError(message, source=self._source,
                         line=(mark.line + 1) if mark is not None else None, hint=hint)

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise self._fail(f"more than {MAX_ALIASES} aliases ('*name')", event.start_mark,
                                 "Write the values out; a task file needs few aliases.")
            if event.anchor in self._open_anchors:
                raise self._fail(f"the alias '*{event.anchor}' refers to a value that contains "
                                 "it (a loop)", event.start_mark,
                                 "Point the alias at a value defined before it, outside it.")
            return super().compose_node(parent, index)
        collection = isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent))
        if collection:
            self._open_depth += 1
            if self._open_depth > MAX_DEPTH:
                raise self._fail(f"values are nested more than {MAX_DEPTH} levels deep",
                                 event.start_mark, "Flatten the structure; task fields are a "
                                 "few levels deep.")
        anchor = getattr(event, "anchor", None)
        if collection and anchor:
            self._open_anchors.add(anchor)
        try:
            node = super().compose_node(parent, index)
        finally:
            if collection:
                self._open_depth -= 1
                if anchor:
                    self._open_anchors.discard(anchor)
        self._measure(node)
        return node

    def _measure(self, node: yaml.Node) -> None:
        if isinstance(node, yaml.MappingNode):
            children = [c for pair in node.value for c in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            self._size[id(node)] = (1, 0)
            return
        size, depth = 1, 0
        for c in children:
            s, d = self._size.get(id(c), (1, 0))
            size, depth = size + s, max(depth, d)
        depth += 1
        if depth > MAX_DEPTH:
            raise self._fail(f"with its aliases expanded, this value is nested more than "
                             f"{MAX_DEPTH} levels deep", node.start_mark,
                             "Use fewer nested aliases.")
        if size > MAX_NODES:
            raise self._fail(f"with its aliases expanded, this value holds more than {MAX_NODES} "
                             "values", node.start_mark,
                             "Write the values out instead of repeating aliases of aliases.")
        self._size[id(node)] = (size, depth)


def _build(node: yaml.Node, path: Path_, lines: dict[Path_, int], source: str) -> Any:
    if node.tag not in _STANDARD_TAGS:
        line = node.start_mark.line + 1
        if node.tag == _MERGE_TAG:
            raise SpecError("merge keys ('<<') are not supported", source=source, line=line,
                            hint="Write the fields out in this mapping (an alias such as "
                                 "'envs: *common' still works).")
        raise SpecError(f"the tag '{node.tag}' is not supported here", source=source, line=line,
                        hint="Task files use plain values (text, numbers, true/false, lists and "
                             "mappings); remove the tag.")
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = _build(key_node, path, lines, source)
            if isinstance(key, (dict, list)):
                raise SpecError("a mapping key must be a plain value", source=source,
                                line=key_node.start_mark.line + 1)
            if key in out:
                raise SpecError(f"'{key}' appears twice", field=".".join(map(str, path + (key,))),
                                source=source, line=key_node.start_mark.line + 1,
                                hint="Keep one of them.")
            lines[path + (key,)] = key_node.start_mark.line + 1
            out[key] = _build(value_node, path + (key,), lines, source)
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for i, child in enumerate(node.value):
            lines[path + (i,)] = child.start_mark.line + 1
            items.append(_build(child, path + (i,), lines, source))
        return items
    # Scalars: let the safe constructor decide the type (int, bool, null, str ...).
    value = _construct_scalar(node, source)
    if isinstance(value, str) and "\0" in value:
        field = ".".join(str(p) for p in path if not isinstance(p, int))   # "": the document
        raise SpecError("a value contains the NUL character (\\0)", source=source,
                        field=field, line=node.start_mark.line + 1,
                        hint="Remove it: no path, name, command or variable can hold one.")
    return value


_SCALAR_LOADER = yaml.SafeLoader("")


def _construct_scalar(node: yaml.Node, source: str = "") -> Any:
    try:
        return _SCALAR_LOADER.construct_object(node, deep=True)
    except Exception as exc:  # noqa: BLE001 - any constructor failure is an unreadable value
        _SCALAR_LOADER.recursive_objects.pop(node, None)
        kind = node.tag.rsplit(":", 1)[-1]
        text = str(node.value)
        shown = text if len(text) <= 40 else text[:37] + "..."
        why = str(exc).splitlines()[0].split(";")[0] if str(exc) else type(exc).__name__
        raise SpecError(f"'{shown}' cannot be read as {kind} ({why})", source=source,
                        line=node.start_mark.line + 1, hint=_QUOTE_HINT) from None


def _yaml_error(exc: yaml.YAMLError, text: str, source: str) -> SpecError:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    unclosed = str(context).startswith(("while parsing a flow", "while scanning a quoted"))
    if mark is not None and context_mark is not None and (
            unclosed or mark.index >= len(text.rstrip())):
        # An unclosed bracket or quote is noticed lines later (or past the last line):
        # point at where it opened.
        problem = f"{context}: {problem}" if context else problem
        mark = context_mark
    if isinstance(exc, yaml.reader.ReaderError):
        problem = f"unacceptable character #x{exc.character:04x} at position {exc.position}"
        mark = None
        line = text.count("\n", 0, exc.position) + 1
        return SpecError(f"this is not valid YAML ({problem})", source=source, line=line,
                         hint="Remove control characters; write them as escapes in a "
                              "double-quoted string if a value needs one.")
    return SpecError(f"this is not valid YAML ({problem})", source=source,
                     line=(mark.line + 1) if mark else None,
                     hint="Check the indentation and quoting around that line.")


def load_located(text: str, source: str) -> LocatedYaml:
    if len(text) > MAX_BYTES:
        raise SpecError(f"the task file is larger than {MAX_BYTES // 1024} kB", source=source,
                        hint="Move long scripts into files in the workdir and run them from "
                             "'run:' or 'setup:'.")
    loader: _BoundedLoader | None = None
    try:
        loader = _BoundedLoader(text, source)
        root = loader.get_single_node()
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, text, source) from None
    except RecursionError:  # not reached with the depth bound; never a traceback all the same
        raise SpecError("values are nested too deeply", source=source,
                        hint="Flatten the structure; task fields are a few levels deep.") from None
    finally:
        if loader is not None:
            loader.dispose()
    if root is None:
        raise SpecError("the task file is empty", source=source,
                        hint="Start from 'cloudtrain init' or the task-file reference in the README.")
    lines: dict[Path_, int] = {}
    try:
        data = _build(root, (), lines, source)
    finally:  # the shared scalar constructor must not keep this file's nodes alive
        _SCALAR_LOADER.constructed_objects.clear()
        _SCALAR_LOADER.recursive_objects.clear()
    return LocatedYaml(data, lines)
