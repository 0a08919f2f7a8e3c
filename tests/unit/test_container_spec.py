"""The task's ``container:`` section as a user meets it: ``cloudtrain launch TASK --dry-run``
refuses a bad image reference, a run option that would undo cloudtrain's settings or hand the
host to the container, and a registry login whose variables are not set on this machine, with
exit 2, the field named and nothing created; the reference grammar and the option checks
themselves (cloudtrain/containers/spec.py) over the cases Docker's own parser decides."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloudtrain.containers.spec import check_run_options, parse_image
from conftest import CLI

DIGEST = "sha256:" + "ab" * 32


def _task(tmp_path: Path, container: str) -> Path:
    p = tmp_path / "task.yaml"
    p.write_text("name: ctspec\nresources: {provider: local}\ncontainer:\n"
                 + "".join(f"  {line}\n" for line in container.strip().splitlines())
                 + "run: 'true'\n")
    return p


def _refused(cli: CLI, task: Path, **env: str) -> str:
    r = cli.run("launch", str(task), "--dry-run", **env)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert not (cli.home / "clusters").exists() or not any((cli.home / "clusters").iterdir())
    return " ".join(r.stderr.split())


@pytest.mark.parametrize("image, words", [
    ("Bad/Image:1", "repository names are lower case"),
    ("repo@sha256:abc", "is not a valid image reference"),
    ("''", "the image is empty"),
    ("nvcr.io/nvidia/pytorch:24.10-py3@sha256:" + "0" * 63, "is not a sha256 digest"),
])
def test_a_bad_image_reference_is_refused_naming_container_image(
        cli: CLI, tmp_path: Path, image: str, words: str) -> None:
    err = _refused(cli, _task(tmp_path, f"image: {image}"))
    assert "field 'container.image'" in err and words in err
    assert "nvcr.io/nvidia/pytorch:24.10-py3" in err        # an example of what to write


@pytest.mark.parametrize("options, words", [
    ("[--privileged]", "set container.privileged: true"),
    ("[--network=bridge]", "host's network"),
    ("[-v, '/:/host']", "host's power"),
    ("[--cap-add=SYS_ADMIN]", "host's power"),
    ("[--mount, 'type=bind,source=/var/run/docker.sock,target=/d']", "host's power"),
    ("[--ipc]", "needs a value: write --ipc=VALUE"),
    ("[--frobnicate]", "is not an option cloudtrain passes on"),
    ("[--user=0]", "the node's SSH user"),
])
def test_a_refused_run_option_names_container_run_options(
        cli: CLI, tmp_path: Path, options: str, words: str) -> None:
    err = _refused(cli, _task(tmp_path, f"image: x:1\nrun_options: {options}"))
    assert "field 'container.run_options'" in err and words in err


def test_privileged_true_allows_what_it_says(cli: CLI, tmp_path: Path) -> None:
    task = _task(tmp_path, "image: x:1\nprivileged: true\nrun_options: [--privileged, -v, "
                           "'/dev:/dev', --ipc=host, --shm-size, 8g]")
    r = cli.run("launch", str(task), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "x:1" in r.stdout + r.stderr


def test_registry_auth_variables_must_be_set_on_this_machine(cli: CLI, tmp_path: Path) -> None:
    task = _task(tmp_path, "image: 127.0.0.1:5000/team/img:1\n"
                           "registry_auth: {username_env: CT_T_USER, password_env: CT_T_KEY}")
    err = _refused(cli, task, CT_T_USER="alice")
    assert "container.registry_auth.password_env" in err and "CT_T_KEY" in err
    assert "export CT_T_KEY=" in err
    err = _refused(cli, task, CT_T_KEY="s3cret")
    assert "container.registry_auth.username_env" in err and "CT_T_USER" in err
    assert "s3cret" not in err
    # Both set: the dry run goes through (nothing is sent anywhere by a dry run).
    r = cli.run("launch", str(task), "--dry-run", CT_T_USER="alice", CT_T_KEY="s3cret")
    assert r.returncode == 0, r.stderr
    assert "s3cret" not in r.stdout + r.stderr


def test_registry_auth_takes_variable_names_not_values(cli: CLI, tmp_path: Path) -> None:
    task = _task(tmp_path, "image: x:1\nregistry_auth: {username_env: alice, "
                           "password_env: 'hunter2 with spaces'}")
    err = _refused(cli, task)
    assert "field 'container.registry_auth.password_env'" in err
    assert "not an environment variable name" in err


# --- the grammar and the checks, directly --------------------------------------------------

@pytest.mark.parametrize("text, name, registry, tag, digest", [
    ("ubuntu", "ubuntu", "docker.io", None, None),
    ("ubuntu:22.04", "ubuntu", "docker.io", "22.04", None),
    ("team/img", "team/img", "docker.io", None, None),
    ("nvcr.io/nvidia/pytorch:24.10-py3", "nvcr.io/nvidia/pytorch", "nvcr.io", "24.10-py3", None),
    ("localhost/img:1", "localhost/img", "localhost", "1", None),
    ("127.0.0.1:5000/a/b:c", "127.0.0.1:5000/a/b", "127.0.0.1:5000", "c", None),
    (f"img@{DIGEST}", "img", "docker.io", None, DIGEST),
    (f"r.io/img:1@{DIGEST}", "r.io/img", "r.io", "1", DIGEST),
])
def test_references_parse_as_docker_reads_them(text: str, name: str, registry: str,
                                               tag: str | None, digest: str | None) -> None:
    ref = parse_image(text)
    assert (ref.name, ref.registry, ref.tag, ref.digest) == (name, registry, tag, digest)
    assert ref.pinned == (digest is not None)


@pytest.mark.parametrize("text", ["UPPER", "a//b", "img:", ":tag", "img:-bad", "a" * 256,
                                  "img@sha256:xyz", "img:tag with space"])
def test_invalid_references_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_image(text)


def test_run_options_keep_their_order_and_values() -> None:
    assert check_run_options(["--ipc=host", "--shm-size", "8g", "-e", "A=1", "--init"],
                             False) == ["--ipc=host", "--shm-size", "8g", "-e", "A=1", "--init"]
    with pytest.raises(ValueError, match="run_options\\[2\\]"):
        check_run_options(["--init", "--read-only", "--gpus=all"], False)
