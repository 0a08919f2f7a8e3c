"""YAML loading that remembers where each key came from, so errors can name the line."""

from __future__ import annotations

from typing import Any

import yaml

from .errors import SpecError

Path_ = tuple[object, ...]


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

    __hash__ = None  # type: ignore[assignment]

    def line_of(self, path: Path_) -> int | None:
        path = tuple(path)
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return None


def _build(node: yaml.Node, path: Path_, lines: dict[Path_, int], source: str) -> Any:
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
    return _construct_scalar(node)


_SCALAR_LOADER = yaml.SafeLoader("")


def _construct_scalar(node: yaml.Node) -> Any:
    return _SCALAR_LOADER.construct_object(node, deep=True)


def load_located(text: str, source: str) -> LocatedYaml:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
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
        raise SpecError(f"this is not valid YAML ({problem})", source=source,
                        line=(mark.line + 1) if mark else None,
                        hint="Check the indentation and quoting around that line.") from None
    if root is None:
        raise SpecError("the task file is empty", source=source,
                        hint="Start from 'cloudtrain init' or the task-file reference in the README.")
    lines: dict[Path_, int] = {}
    data = _build(root, (), lines, source)
    return LocatedYaml(data, lines)
