"""cloudtrain/check.py with provider instances handed in (as a program embedding the CLI
hands them, ``cli.main(args, obj={...})``): a provider that never answers is reported once
its deadline passes, without waiting for it; one that fails unexpectedly, or cannot check
its access at all, is reported and does not hide the others."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from click.testing import CliRunner

from cloudtrain import check
from cloudtrain.commands.main import cli
from cloudtrain.provider import ProviderCheck, ProviderContext


class Hangs:
    def __init__(self) -> None:
        self.release = threading.Event()

    def check_access(self, timeout: float) -> ProviderCheck:
        self.release.wait(60)
        return ProviderCheck("aws", True, "late", True)


class Breaks:
    def check_access(self, timeout: float) -> ProviderCheck:
        raise RuntimeError("the SDK changed under us")


class Answers:
    def __init__(self, name: str) -> None:
        self.name = name
        self.asked: list[float] = []

    def check_access(self, timeout: float) -> ProviderCheck:
        self.asked.append(timeout)
        return ProviderCheck(self.name, True, "env", True, (f"{self.name} things",))


class CannotCheck:
    pass


def test_a_provider_that_never_answers_is_reported_at_its_deadline(tmp_path: Path) -> None:
    hangs = Hangs()
    gcp = Answers("gcp")
    began = time.monotonic()
    try:
        got = check.check(["aws", "gcp", "azure", "local"], ProviderContext(tmp_path),
                          {"aws": hangs, "gcp": gcp, "azure": Breaks(), "local": CannotCheck()},
                          timeout=2.5, deadline=1.0)
    finally:
        hangs.release.set()
    assert time.monotonic() - began < 5
    assert [r.provider for r in got] == ["aws", "gcp", "azure", "local"]
    aws, g, azure, local = got
    assert aws.works is None and not aws.usable and aws.detail == "no answer within 1 s"
    assert "cloudtrain check aws" in aws.fix
    assert g.usable and g.reaches == ("gcp things",) and gcp.asked == [2.5]
    assert azure.works is False and azure.detail == "RuntimeError: the SDK changed under us"
    assert local.credentials is None and local.detail == "this provider cannot check its access"
    assert check.exit_code(got) == 0 and check.usable_clouds(got) == ["gcp"]
    assert check.exit_code([aws, azure]) == 1


def test_the_command_asks_the_handed_providers_and_exits_by_the_clouds(tmp_path: Path) -> None:
    runner = CliRunner(env={"CLOUDTRAIN_HOME": str(tmp_path / "home"), "NO_COLOR": "1"})
    gcp = Answers("gcp")
    r = runner.invoke(cli, ["check", "gcp", "azure", "--timeout", "3"],
                      obj={"gcp": gcp, "azure": Breaks()})
    assert r.exit_code == 0, r.output
    assert gcp.asked == [3.0]
    lines = r.output.splitlines()
    assert lines[1].split()[:4] == ["gcp", "yes", "env", "yes"]
    assert lines[2].split()[:4] == ["azure", "yes", "?", "no"]
    assert lines[-1] == "Usable: gcp."
    r = runner.invoke(cli, ["check", "azure"], obj={"azure": Breaks()})
    assert r.exit_code == 1
    assert r.output.splitlines()[-1] == "Usable: none; no cloud is usable (see WHAT TO DO above)."
