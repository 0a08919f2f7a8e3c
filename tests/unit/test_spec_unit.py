"""Fast unit tests of the task-file model: cloudtrain.spec.parse_task, with the provider checks
of cloudtrain.provider.options (parse_checked, provider_options)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloudtrain.errors import SpecError, UserError
from cloudtrain.provider.options import parse_checked, provider_options


def parse(text: str, **kw):  # type: ignore[no-untyped-def]
    return parse_checked(text, source="task.yaml", **kw)


def refused(text: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse(text)
    return info.value


# --- defaults ---------------------------------------------------------------------------------


def test_minimal_task_defaults() -> None:
    t = parse("run: echo hi\n")
    assert t.run == "echo hi"
    assert t.train is None
    assert t.num_nodes == 1
    assert t.resources.provider == "local"
    assert t.resources.accelerators is None
    assert t.resources.ports == [] and t.resources.ssh_cidr is None
    assert t.outputs == [] and t.outputs_from == "head"
    assert t.workdir is None and t.workdir_path() is None


def test_relative_paths_start_at_base_dir(tmp_path: Path) -> None:
    t = parse("workdir: proj\noutputs_dir: out\nrun: x\n", base_dir=tmp_path)
    assert t.workdir_path() == (tmp_path / "proj").resolve()
    assert t.outputs_path() == (tmp_path / "out").resolve()


# --- accelerators -----------------------------------------------------------------------------


@pytest.mark.parametrize("value, name, count", [
    ("A100:8", "A100", 8),
    ("H100:1", "H100", 1),
    ("{A100: 8}", "A100", 8),
    ("{name: L4, count: 2}", "L4", 2),
    ("A100", "A100", 1),
    ("' V100 :4'", "V100", 4),
], ids=["string-name-count", "string-count-1", "mapping", "name-count-mapping", "bare-name",
        "spaces-around-name"])
def test_accelerator_forms(value: str, name: str, count: int) -> None:
    acc = parse(f"resources:\n  accelerators: {value}\nrun: x\n").resources.accelerators
    assert acc is not None
    assert (acc.name, acc.count) == (name, count)
    assert str(acc) == f"{name}:{count}"


@pytest.mark.parametrize("resources", ["{}", "{accelerators: null}", "{accelerators: none}",
                                       "{accelerators: ''}"],
                         ids=["absent", "null", "none", "empty-string"])
def test_no_accelerators_is_none(resources: str) -> None:
    assert parse(f"resources: {resources}\nrun: x\n").resources.accelerators is None


@pytest.mark.parametrize("value, words", [
    ("A100:three", "three"),
    ("A100:0", "greater than or equal to 1"),
    ("A100:65", "less than or equal to 64"),
    ("':8'", "NAME[:COUNT]"),
    ("{A100: 2, H100: 2}", "one GPU model"),
    ("{A100: lots}", "lots"),
    ("{A100: true}", "True"),
    ("[A100, 8]", "NAME[:COUNT]"),
], ids=["count-word", "count-zero", "count-too-big", "no-name", "two-models", "mapping-count-word",
        "mapping-count-bool", "list"])
def test_bad_accelerators(value: str, words: str) -> None:
    err = refused(f"run: x\nresources:\n  accelerators: {value}\n")
    assert err.field in ("resources.accelerators", "resources.accelerators.count")
    assert err.line == 3
    assert words in str(err)


# --- envs -------------------------------------------------------------------------------------


def test_envs_are_coerced_to_strings() -> None:
    t = parse("run: x\nenvs:\n  INT: 3\n  FLOAT: 0.5\n  ON_: true\n  OFF_: false\n  EMPTY: null\n"
              "  TEXT: hello\n  _UNDER: '007'\n")
    assert t.envs == {"INT": "3", "FLOAT": "0.5", "ON_": "true", "OFF_": "false", "EMPTY": "",
                      "TEXT": "hello", "_UNDER": "007"}
    assert all(isinstance(v, str) for v in t.envs.values())


@pytest.mark.parametrize("key", ["1ABC", "MY-VAR", "A B"])
def test_env_names_must_be_identifiers(key: str) -> None:
    err = refused(f"run: x\nenvs:\n  '{key}': v\n")
    assert err.field == "envs"
    assert key in str(err)


def test_env_values_must_be_scalars() -> None:
    err = refused("run: x\nenvs:\n  A: [1, 2]\n")
    assert err.field.startswith("envs")


# --- train ------------------------------------------------------------------------------------


def test_train_defaults() -> None:
    t = parse("train:\n  module: pkg.train\n")
    assert t.train is not None and t.run is None
    assert t.train.module == "pkg.train" and t.train.script is None
    assert t.train.nproc_per_node == "auto"
    assert t.train.rendezvous == "static"
    assert t.train.max_restarts == 0
    assert t.train.master_port is None
    assert t.train.args == []


def test_train_args_numbers_become_strings_and_settings_are_kept() -> None:
    t = parse("train:\n  script: train.py\n  args: [--lr, 0.1, --epochs, 3, --flag]\n"
              "  nproc_per_node: 4\n  rendezvous: c10d\n  max_restarts: 2\n")
    assert t.train is not None
    assert t.train.args == ["--lr", "0.1", "--epochs", "3", "--flag"]
    assert t.train.nproc_per_node == 4
    assert t.train.rendezvous == "c10d"
    assert t.train.max_restarts == 2


@pytest.mark.parametrize("body, field, line", [
    ("  module: m\n  rendezvous: etcd\n", "train.rendezvous", 4),
    ("  module: m\n  nproc_per_node: 0\n", "train.nproc_per_node", 4),
    ("  module: m\n  nproc_per_node: many\n", "train.nproc_per_node", 4),
    ("  module: m\n  master_port: 80\n", "train.master_port", 4),
    ("  script: a.py\n  module: m\n", "train", 2),
    ("  args: [--x]\n", "train", 2),
], ids=["rendezvous", "nproc-zero", "nproc-word", "master-port-privileged", "script-and-module",
        "neither-script-nor-module"])
def test_bad_train(body: str, field: str, line: int) -> None:
    err = refused("name: job\ntrain:\n" + body)
    assert (err.field, err.line) == (field, line)


def test_run_and_train_are_exclusive() -> None:
    assert "not both" in str(refused("run: x\ntrain:\n  module: m\n"))
    assert "'run'" in str(refused("num_nodes: 2\n"))


# --- outputs ----------------------------------------------------------------------------------


def test_outputs_inside_workdir_are_accepted() -> None:
    t = parse("run: x\noutputs: [ckpt/, logs/run.txt, a..b/c]\n")
    assert t.outputs == ["ckpt/", "logs/run.txt", "a..b/c"]


@pytest.mark.parametrize("bad", ["/abs/ckpt", "../up", "ckpt/../../etc", ".."])
def test_outputs_outside_workdir_are_refused(bad: str) -> None:
    err = refused(f"run: x\noutputs: [ok/, '{bad}']\n")
    assert err.field == "outputs"
    assert err.line == 2
    assert bad in str(err)


# --- names ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a", "my-job", "job2", "a" * 40, "x-1-y"])
def test_good_names(name: str) -> None:
    assert parse(f"name: {name}\nrun: x\n").name == name


# SkyPilot's names ('My-Job', 'my_job', 'job.1') are kept as the job's name, the cluster name
# derived from them: tests/unit/test_skypilot_fields.py.
@pytest.mark.parametrize("name", ["-job", "9job", "a" * 64, "'my job'", "'job/1'"])
def test_bad_names(name: str) -> None:
    err = refused(f"run: x\nname: {name}\n")
    assert (err.field, err.line) == ("name", 2)


# --- resources --------------------------------------------------------------------------------


def test_ssh_cidr_is_normalised() -> None:
    assert parse("run: x\nresources: {ssh_cidr: 10.1.2.3/24}\n").resources.ssh_cidr == "10.1.2.0/24"
    assert parse("run: x\nresources: {ssh_cidr: 203.0.113.7}\n").resources.ssh_cidr == \
        "203.0.113.7/32"


@pytest.mark.parametrize("ports, word", [("[0]", "0"), ("[65536]", "65536"), ("[22]", "22"),
                                         ("[http]", "http")])
def test_bad_ports(ports: str, word: str) -> None:
    err = refused(f"run: x\nresources:\n  ports: {ports}\n")
    assert err.field.startswith("resources.ports")
    assert err.line == 3
    assert word in str(err)


def test_unknown_field_names_field_line_and_suggestion() -> None:
    err = refused("run: x\nresources:\n  provider: local\n  instance_typ: m5\n")
    assert (err.field, err.line) == ("resources.instance_typ", 4)
    assert "instance_type" in err.hint


def test_unknown_provider_is_reported_at_parse_time() -> None:
    err = refused("run: x\nresources:\n  provider: awz\n")
    assert (err.field, err.line) == ("resources.provider", 3)
    assert "local" in err.hint and "ssh" in err.hint


def test_options_for_another_provider_are_refused() -> None:
    err = refused("run: x\nresources:\n  provider: local\n  ssh: {hosts: [a]}\n")
    assert (err.field, err.line) == ("resources.ssh", 4)
    assert "provider: ssh" in err.hint


def test_duplicate_key_names_second_occurrence() -> None:
    err = refused("run: x\nresources:\n  use_spot: false\n  use_spot: true\n")
    assert (err.field, err.line) == ("resources.use_spot", 4)


@pytest.mark.parametrize("text, line", [
    ("run: x\nnum_nodes: 1\n  setup: y\n", 3),
    ("run: x\nsetup: [a, b\nnum_nodes: 1\n", 2),
    ("name: job\nrun: 'echo\n", 2),
], ids=["indentation", "unclosed-bracket", "unclosed-quote"])
def test_yaml_errors_name_the_line(text: str, line: int) -> None:
    err = refused(text)
    assert err.line == line
    assert "not valid YAML" in str(err)


# --- provider options -------------------------------------------------------------------------


def test_local_options_netns_ok() -> None:
    opts = provider_options(parse("run: x\nresources:\n  local:\n    network: netns\n"))
    assert opts is not None
    assert type(opts).__name__ == "LocalOptions"
    assert opts.network == "netns"  # type: ignore[attr-defined]


@pytest.mark.parametrize("resources", ["{}", "{local: null}", "{local: {}}"],
                         ids=["absent", "null", "empty"])
def test_local_options_default_to_loopback(resources: str) -> None:
    opts = provider_options(parse(f"run: x\nresources: {resources}\n"))
    assert opts is not None and opts.network == "loopback"  # type: ignore[attr-defined]


def test_local_options_bogus_network() -> None:
    task = parse("run: x\nresources:\n  provider: local\n  local:\n    network: bogus\n")
    with pytest.raises(SpecError) as info:
        provider_options(task)
    assert info.value.field == "resources.local.network"
    assert info.value.line == 5
    assert "resources.local.network" in str(info.value)
    assert "netns" in str(info.value)


def test_local_options_unknown_key_suggests() -> None:
    task = parse("run: x\nresources:\n  local:\n    netwrk: netns\n")
    with pytest.raises(SpecError) as info:
        provider_options(task)
    assert info.value.field == "resources.local.netwrk"
    assert "'network'" in info.value.hint


def test_ssh_options_host_strings() -> None:
    task = parse("run: x\nresources:\n  provider: ssh\n  ssh:\n"
                 "    hosts: [me@10.0.0.1:2222, 10.0.0.2]\n")
    opts = provider_options(task)
    hosts = opts.hosts  # type: ignore[union-attr]
    assert [(h.address, h.port) for h in hosts] == [("10.0.0.1", 2222), ("10.0.0.2", 22)]
    assert hosts[0].user == "me"


def test_ssh_options_need_hosts() -> None:
    task = parse("run: x\nresources:\n  provider: ssh\n")
    with pytest.raises(SpecError) as info:
        provider_options(task)
    assert info.value.field == "resources.ssh.hosts"


def test_spec_error_is_a_user_error_with_exit_code_2() -> None:
    err = refused("num_node: 2\nrun: x\n")
    assert isinstance(err, UserError) and err.exit_code == 2
    assert (err.field, err.line) == ("num_node", 1)
    assert "num_nodes" in err.hint
    assert str(err).startswith("task.yaml, line 1: field 'num_node': unknown field")
