"""containers/runtime.py: the warm check that lets a launch skip docker, and the refusal of a
node without Docker (exit 2 naming ``container`` and the fix), before anything is started."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cloudtrain.containers import runtime
from cloudtrain.containers.spec import ContainerSpec
from cloudtrain.errors import UserError
from cloudtrain.pipeline.prep import NodeFacts, prep_facts
from cloudtrain.remote import GroupResult
from cloudtrain.connection import Result


def _facts(line: str, start: str) -> NodeFacts:
    return NodeFacts(True, "", "", docker=True, container=line, keeper_start=start)


def test_warm_only_when_name_request_and_keeper_match() -> None:
    line = "ct-abc-0 req1 4242 998877 repo@sha256:" + "a" * 64
    assert runtime.warm_digest(_facts(line, "998877"), "ct-abc-0", "req1") == \
        "repo@sha256:" + "a" * 64
    assert runtime.warm_digest(_facts(line, "998878"), "ct-abc-0", "req1") is None  # pid reused
    assert runtime.warm_digest(_facts(line, ""), "ct-abc-0", "req1") is None        # keeper gone
    assert runtime.warm_digest(_facts(line, "998877"), "ct-abc-0", "req2") is None  # options
    assert runtime.warm_digest(_facts(line, "998877"), "ct-xyz-0", "req1") is None  # cluster
    assert runtime.warm_digest(_facts("", ""), "ct-abc-0", "req1") is None


def test_request_hash_changes_with_image_options_and_mounts() -> None:
    node = SimpleNamespace(gpus=0)
    a = ContainerSpec(image="repo/a:1")
    base = runtime.request_hash(a, node, [])  # type: ignore[arg-type]
    assert base == runtime.request_hash(ContainerSpec(image="repo/a:1"), node, [])  # type: ignore[arg-type]
    assert base != runtime.request_hash(ContainerSpec(image="repo/a:2"), node, [])  # type: ignore[arg-type]
    assert base != runtime.request_hash(ContainerSpec(image="repo/a:1", run_options=["--shm-size=1g"]),
                                        node, [])  # type: ignore[arg-type]
    assert base != runtime.request_hash(a, node, ["/data"])  # type: ignore[arg-type]
    assert base != runtime.request_hash(a, SimpleNamespace(gpus=8), [])  # type: ignore[arg-type]


def test_prep_output_is_read_into_facts() -> None:
    out = "boot=yes\nsync=fp\nsetup=h\ndocker=yes\ncontainer=ct-a-0 r 12 34 d\nkeeper=34\n"
    res = GroupResult({0: Result(0, 0, out, "")})
    f = prep_facts(res)[0]
    assert (f.docker, f.container, f.keeper_start) == (True, "ct-a-0 r 12 34 d", "34")


def test_a_node_without_docker_is_refused_naming_container_and_the_fix() -> None:
    task = SimpleNamespace(container=ContainerSpec(image="repo/a:1"))
    handle = SimpleNamespace(name="c1", nodes=[])
    prep = {0: NodeFacts(True, "", "", docker=True), 1: NodeFacts(True, "", "", docker=False)}
    with pytest.raises(UserError) as e:
        runtime.ready(None, handle, None, task, prep)  # type: ignore[arg-type]
    assert e.value.exit_code == 2
    assert "container:" in str(e.value) and "[1]" in str(e.value)
    assert "Install Docker" in e.value.hint
