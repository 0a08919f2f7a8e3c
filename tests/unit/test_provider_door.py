"""The provider door: the built-in providers come through ``cloudtrain.provider`` (and
``cloudtrain.errors``) only, as a third-party plugin would; and the provider errors carry
their code and zone as typed fields."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from cloudtrain.errors import CapacityError, ProviderError, QuotaError, code_of

PROVISIONERS = Path(__file__).resolve().parents[2] / "provisioners" / "cloudtrain_provisioners"
# cloudtrain.node: the node-side programs (standard library only), which a provider whose
# guard runs somewhere of its own (slurm: inside the allocation) ships and reuses.
ALLOWED = ("cloudtrain.provider", "cloudtrain.errors", "cloudtrain.node")


def _cloudtrain_imports(path: Path) -> list[tuple[int, str]]:
    """Every ``cloudtrain.*`` module ``path`` imports (at any depth, lazily or not)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "cloudtrain":   # from cloudtrain import x: the module cloudtrain.x
                found += [(node.lineno, f"cloudtrain.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
    return [(line, m) for line, m in found if m == "cloudtrain" or m.startswith("cloudtrain.")]


def test_the_provisioners_are_where_the_test_looks() -> None:
    modules = sorted(PROVISIONERS.rglob("*.py"))
    assert {p.parent.name for p in modules} >= {"aws", "gcp", "azure", "local", "ssh"}
    assert sum(1 for p in modules for _ in _cloudtrain_imports(p)) > 10


def test_built_in_providers_import_only_the_door() -> None:
    wrong = [f"{p.relative_to(PROVISIONERS)}:{line}: {m}"
             for p in sorted(PROVISIONERS.rglob("*.py")) for line, m in _cloudtrain_imports(p)
             if not any(m == a or m.startswith(a + ".") for a in ALLOWED)]
    assert wrong == [], "\n".join(wrong)


def test_the_door_has_what_the_providers_ask_it_for() -> None:
    import cloudtrain.provider as door

    asked = set()
    for p in PROVISIONERS.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "cloudtrain.provider":
                asked |= {a.name for a in node.names}
    assert asked and all(hasattr(door, name) for name in asked), sorted(
        n for n in asked if not hasattr(door, n))
    assert set(asked) <= set(door.__all__) | {"registry"}


@pytest.mark.parametrize("cls", [ProviderError, CapacityError, QuotaError])
def test_provider_errors_carry_code_and_zone_as_typed_fields(cls: type[ProviderError]) -> None:
    params = inspect.signature(cls.__init__).parameters
    for field in ("code", "zone"):
        assert params[field].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[field].default is None
    hints = inspect.get_annotations(ProviderError.__init__, eval_str=True)
    assert hints["code"] == str | None and hints["zone"] == str | None

    err = cls("no room", "try another zone", code="ZONE_RESOURCE_POOL_EXHAUSTED",
              zone="us-central1-a")
    assert (err.code, err.zone, err.message, err.hint) == (
        "ZONE_RESOURCE_POOL_EXHAUSTED", "us-central1-a", "no room", "try another zone")
    assert code_of(err) == "ZONE_RESOURCE_POOL_EXHAUSTED"
    plain = cls("no room")
    assert plain.code is None and plain.zone is None and code_of(plain) == cls.__name__


def test_code_of_any_exception_is_its_class_name() -> None:
    assert code_of(ValueError("x")) == "ValueError"


def test_every_name_of_the_door_is_declared_and_resolves() -> None:
    """``__all__`` spells out the lazily imported names too (checkers and ``import *`` see
    them), and each one resolves."""
    import cloudtrain.provider as door

    assert set(door._LAZY) <= set(door.__all__)
    for name in door.__all__:
        assert getattr(door, name) is not None
