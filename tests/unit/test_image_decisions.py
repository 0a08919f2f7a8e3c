"""ensure_image's decisions on answers from nodes that see different Docker Engines (local
nodes share one, so two nodes that see different images are played here by a Group that gives
each node its own answer, in the lines node/dockerpull.py prints): the node that differs is
named, every failing node is named with Docker's reason, a refused login names
container.registry_auth, the login travels on stdin only and never shows in a message; and
dockerpull.py's own reading of the Engine's progress stream."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from cloudtrain.connection import Result
from cloudtrain.containers import pull
from cloudtrain.containers.spec import ContainerSpec
from cloudtrain.errors import RemoteError, UserError
from cloudtrain.remote import GroupResult
from cloudtrain.schema import NodeRow
from cloudtrain.state import open_state
from cloudtrain.ui import UI

sys.path.insert(0, str(Path(pull.__file__).resolve().parent.parent / "node"))
import dockerpull  # noqa: E402

A = "r.io/team/img@sha256:" + "a" * 64
B = "r.io/team/img@sha256:" + "b" * 64


def _image(how: str, image_id: str, digests: list[str]) -> str:
    return f"::image {how} " + json.dumps({"id": image_id, "repo_digests": digests})


class Nodes:
    """A Group whose nodes answer with the lines given per rank (exit code 0 unless a
    ``::fail`` line says otherwise), keeping what each was sent."""

    def __init__(self, answers: dict[int, str]) -> None:
        self.answers = answers
        self.nodes = [NodeRow("c", r, f"i-{r}", "127.0.0.1", 22, "u", "10.0.0.1", "running",
                              "ct") for r in answers]
        self.commands: list[str] = []
        self.stdin: list[bytes] = []

    def run(self, command: Callable[[NodeRow], str], *, stdin: bytes,
            on_line: Callable[[int, str], None], timeout: float) -> GroupResult:
        out = GroupResult()
        for n in self.nodes:
            self.commands.append(command(n))
            self.stdin.append(stdin)
            text = self.answers[n.rank]
            for line in text.splitlines():
                on_line(n.rank, line)
            code = {"auth": 3, "pull": 4}.get(text.split()[1], 5) if text.startswith(
                "::fail") else 0
            out[n.rank] = Result(n.rank, code, text + "\n", "")
        return out


@pytest.fixture
def env(tmp_path: Path) -> Any:
    return SimpleNamespace(ui=UI(quiet=True), state=open_state(tmp_path))


def _ensure(env: Any, nodes: Nodes, spec: ContainerSpec) -> pull.ImageOnNodes:
    handle = SimpleNamespace(name=f"c{id(nodes)}", nodes=nodes.nodes)
    return pull.ensure_image(env, handle, nodes, spec)  # type: ignore[arg-type]


def test_the_node_that_runs_another_digest_is_named(env: Any) -> None:
    nodes = Nodes({0: _image("present", "sha256:1", [A]), 1: _image("pulled", "sha256:2", [B]),
                   2: _image("present", "sha256:1", [A])})
    with pytest.raises(UserError) as e:
        _ensure(env, nodes, ContainerSpec(image="r.io/team/img:1"))
    assert f"node 1 runs {B}" in e.value.message and "node(s) 0, 2 run " + A in e.value.message
    assert "Pin the image by digest" in e.value.hint


def test_the_same_digest_everywhere_is_the_clusters_and_is_recorded(env: Any) -> None:
    nodes = Nodes({0: _image("pulled", "sha256:1", ["other.io/x@sha256:" + "c" * 64, A]),
                   1: _image("present", "sha256:1", [A])})
    got = _ensure(env, nodes, ContainerSpec(image="r.io/team/img:1"))
    assert (got.digest, got.image_id) == (A, "sha256:1")
    assert [n.pulled for n in got.nodes.values()] == [True, False]
    handle_name = f"c{id(nodes)}"
    assert env.state.cluster_image(handle_name) == ("r.io/team/img:1", A, "sha256:1")


def test_a_local_image_without_a_registry_digest_is_known_by_its_id(env: Any) -> None:
    nodes = Nodes({0: _image("present", "sha256:" + "9" * 64, []),
                   1: _image("present", "sha256:" + "9" * 64, [])})
    assert _ensure(env, nodes, ContainerSpec(image="localimg:dev")).digest == "sha256:" + "9" * 64


def test_every_failing_node_is_named_with_dockers_reason(env: Any) -> None:
    nodes = Nodes({0: _image("pulled", "sha256:1", [A]),
                   1: "::fail pull manifest for r.io/team/img:1 not found: manifest unknown",
                   2: "::fail engine cannot reach the Docker Engine at /x.sock"})
    with pytest.raises(RemoteError) as e:
        _ensure(env, nodes, ContainerSpec(image="r.io/team/img:1"))
    msg = e.value.message
    assert "on 2 of 3 node(s)" in msg and "node 1: manifest for r.io/team/img:1 not found" in msg
    assert "node 2: cannot reach the Docker Engine at /x.sock" in msg and "node 0" not in msg


def test_the_login_goes_on_stdin_only_and_never_into_a_message(
        env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("T_USER", "alice")
    monkeypatch.setenv("T_KEY", "pa55word")
    spec = ContainerSpec(image="r.io/team/img:1",
                         registry_auth={"username_env": "T_USER", "password_env": "T_KEY"})
    # A registry whose refusal repeats the password (Docker's never does; the scrub holds anyway).
    nodes = Nodes({0: "::fail auth unauthorized for pa55word", 1: _image("present", "s", [A])})
    with pytest.raises(UserError) as e:
        _ensure(env, nodes, spec)
    text = str(e.value)
    assert "container.registry_auth" in text and "$T_USER / $T_KEY" in text and "node 0" in text
    assert "pa55word" not in text
    header = json.loads(base64.urlsafe_b64decode(nodes.stdin[0].strip()))
    assert header == {"username": "alice", "password": "pa55word", "serveraddress": "r.io"}
    assert all("pa55word" not in c and nodes.stdin[0].strip().decode() not in c
               for c in nodes.commands)


def test_docker_hub_logins_name_the_hub_as_docker_login_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("U", "u")
    monkeypatch.setenv("K", "k")
    creds = pull.credentials(ContainerSpec(image="team/img:1", registry_auth={
        "username_env": "U", "password_env": "K"}))
    assert json.loads(base64.urlsafe_b64decode(creds.header))["serveraddress"] == \
        "https://index.docker.io/v1/"


def test_the_progress_stream_counts_layers_and_bytes() -> None:
    p = dockerpull.Progress()
    for msg in [{"status": "Pulling from team/img", "id": "1"},
                {"status": "Pulling fs layer", "id": "l1"}, {"status": "Pulling fs layer", "id": "l2"},
                {"status": "Already exists", "id": "l0"},
                {"status": "Downloading", "id": "l1", "progressDetail": {"current": 50, "total": 100}},
                {"status": "Downloading", "id": "l2", "progressDetail": {"current": 10, "total": 400}},
                {"status": "Download complete", "id": "l1"}, {"status": "Pull complete", "id": "l1"},
                {"status": "Digest: sha256:" + "a" * 64}]:
        p.take(msg)
    assert p.line(0.0).split()[1:5] == ["2", "3", "110", "500"]


@pytest.mark.parametrize("image, name, tag", [
    ("img", "img", "latest"), ("r.io:5000/a/img", "r.io:5000/a/img", "latest"),
    ("r.io:5000/a/img:1", "r.io:5000/a/img", "1"), (A, "r.io/team/img", "sha256:" + "a" * 64)])
def test_the_engine_is_asked_as_the_docker_cli_asks_it(image: str, name: str, tag: str) -> None:
    assert dockerpull.split(image) == (name, tag)


def test_the_pulled_list_keeps_one_line_per_image(tmp_path: Path) -> None:
    dockerpull.record(str(tmp_path), "a:1", keep=False)
    dockerpull.record(str(tmp_path), "b:1", keep=False)
    dockerpull.record(str(tmp_path), "a:1", keep=False)
    assert (tmp_path / "pulled-images").read_text() == "b:1\na:1\n"
    dockerpull.record(str(tmp_path), "b:1", keep=True)      # keep_image: not ours to remove
    assert (tmp_path / "pulled-images").read_text() == "a:1\n"


def test_a_version_4_database_gains_the_launch_image_columns(tmp_path: Path) -> None:
    import sqlite3

    db = sqlite3.connect(tmp_path / "state.db")
    db.executescript("CREATE TABLE launches (id INTEGER PRIMARY KEY AUTOINCREMENT, cluster TEXT "
                     "NOT NULL, job_id TEXT NOT NULL UNIQUE, task_name TEXT, status TEXT NOT "
                     "NULL, detached INTEGER NOT NULL DEFAULT 0, started_at REAL NOT NULL, "
                     "ended_at REAL, exit_code INTEGER, failed_node INTEGER, end_reason TEXT);"
                     "INSERT INTO launches (cluster, job_id, status, started_at) "
                     "VALUES ('c', 'old', 'SUCCEEDED', 1.0); PRAGMA user_version=4;")
    db.close()
    state = open_state(tmp_path)
    [old] = state.launches("c")
    assert (old.image, old.image_digest) == (None, None)
    state.set_cluster_image("c", "r.io/team/img:1", A, "sha256:1")
    state.add_launch("c", "new", None, False, ContainerSpec(image="r.io/team/img:1"))
    state.add_launch("c", "other", None, False, ContainerSpec(image="r.io/team/img:2"))
    state.add_launch("c", "plain", None, False)
    got = {r.job_id: (r.image, r.image_digest) for r in state.launches("c")}
    assert got == {"old": (None, None), "new": ("r.io/team/img:1", A),
                   "other": ("r.io/team/img:2", None), "plain": (None, None)}


def test_where_docker_needs_sudo_the_pull_and_the_removal_go_through_it(tmp_path: Path) -> None:
    """A node where bootstrap found the user not yet in group docker (docker_sudo=1): the
    pull's helper and every docker command of down's removal run under 'sudo -n'."""
    import os
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    (bin_dir / "sudo").write_text(f"#!/bin/sh\necho \"sudo $*\" >> {log}\nshift\nexec \"$@\"\n")
    (bin_dir / "docker").write_text(
        f"#!/bin/sh\necho \"docker $*\" >> {log}\n"
        "case \"$1 $2\" in 'image inspect') echo sha256:1 ;; esac\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    root = tmp_path / "root"
    root.mkdir()
    (root / "pulled-images").write_text("r.io/team/img:1\n")
    node = NodeRow("c", 0, "i", "h", 22, "u", "ip", "running", str(root),
                   bootstrap={"docker_sudo": "1"})
    out = subprocess.run(pull.forget_images_command(node), shell=True, capture_output=True,
                         text=True, env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert out.stdout.strip() == "::removed r.io/team/img:1", out.stderr
    calls = log.read_text().splitlines()
    assert [c for c in calls if c.startswith("sudo")] == [
        "sudo -n docker image inspect --format {{.Id}} r.io/team/img:1",
        "sudo -n docker ps -a -q --filter ancestor=sha256:1",
        "sudo -n docker image rm r.io/team/img:1"]
    assert not (root / "pulled-images").exists()
    assert "exec sudo -n \"$py\"" in pull.pull_command(node, "r.io/team/img:1", False)
    plain = NodeRow("c", 0, "i", "h", 22, "u", "ip", "running", str(root))
    assert "exec sudo" not in pull.pull_command(plain, "r.io/team/img:1", False)
