"""The suite's skips, told and checked (a pytest plugin, loaded by tests/conftest.py).

Every run ends with the list of skipped tests and their reasons, counted. A skip is only true
when what it says is missing is missing on this machine: each allowed reason below comes with
the check that proves it. With ``CLOUDTRAIN_STRICT_SKIPS=1`` (the README's test command and CI
set it) a skip whose reason is not in the table, or whose check says the thing is there after
all (a false "not installed", a "needs root" as root), fails the run: a test that should run
must run.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parent.parent


def _no_gpu() -> bool:
    return shutil.which("nvidia-smi") is None


def _not_root_or_no_ip() -> bool:
    return os.geteuid() != 0 or shutil.which("ip") is None


def _no_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return True
    import subprocess
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0


def _not_a_checkout() -> bool:
    return shutil.which("git") is None or not (REPO / ".git").exists()


def _not_editable() -> bool:
    spec = importlib.util.find_spec("cloudtrain")
    origin = Path(spec.origin).resolve().parent if spec and spec.origin else None
    return origin != REPO / "cloudtrain"


def _no_shared_catalog() -> bool:
    return not (REPO.parent / "shared" / "catalog" / "gpu_offers.csv").is_file()


@dataclass(frozen=True)
class Allowed:
    pattern: str                  # a regex the skip's reason must match
    true_when: Callable[[], bool]  # the check: True where the reason holds on this machine
    why: str


# Reasons a skip may give on a machine set up by scripts/setup.sh. "X not installed" is not
# among them: setup installs every SDK, emulator and tool the tests use.
ALLOWED = (
    Allowed(r"network namespaces need root|needs root and ip netns", _not_root_or_no_ip,
            "network namespaces need root and iproute2"),
    Allowed(r"needs root and a working 'unshare -n'", _no_unshare,
            "a network-less namespace needs root"),
    Allowed(r"\bGPU\b", _no_gpu, "the GPU checks need an NVIDIA GPU"),
    Allowed(r"not a git checkout", _not_a_checkout, "the wheel's contents are checked against git"),
    Allowed(r"not installed editable from this checkout", _not_editable,
            "the check reads the checkout's own package"),
    Allowed(r"\.\./shared/catalog absent", _no_shared_catalog,
            "the catalog's sources live beside the repo"),
    Allowed(r"a test Slurm cluster needs root", lambda: os.geteuid() != 0,
            "the test Slurm cluster's daemons need root (tests/slurmkit.py)"),
)


# Skips CI must never take, whatever the machine: what they need, scripts/setup.sh --tests
# installs and starts (tests/dockerkit.py gives these reasons).
MUST_RUN = (
    (r"needs a Docker Engine", "CI must run the Docker tests: scripts/setup.sh --tests installs "
                               "docker.io, docker-registry and apache2-utils and starts the "
                               "Engine with scripts/dockerd.sh"),
)


def verdict(reason: str) -> str | None:
    """None when ``reason`` is a true skip here; else why it is not."""
    for pattern, why in MUST_RUN:
        if re.search(pattern, reason):
            return why
    for a in ALLOWED:
        if re.search(a.pattern, reason):
            return None if a.true_when() else f"not true here ({a.why}: it is available)"
    return "not a reason this suite allows (tests/skipcheck.py ALLOWED)"


def _reason(report: pytest.TestReport) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2]).removeprefix("Skipped: ")
    return str(lr)


class SkipCheck:
    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.skips: list[tuple[str, str]] = []

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips.append((report.nodeid, _reason(report)))

    def wrong(self) -> list[tuple[str, str, str]]:
        return [(n, r, w) for n, r in self.skips if (w := verdict(r)) is not None]

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter) -> None:  # type: ignore[no-untyped-def]
        tr = terminalreporter
        by_reason: dict[str, list[str]] = {}
        for nodeid, reason in self.skips:
            by_reason.setdefault(reason, []).append(nodeid)
        tr.write_sep("-", f"{len(self.skips)} skipped")
        for reason, ids in sorted(by_reason.items()):
            tr.write_line(f"{len(ids):4d}  {reason}")
            for i in ids[:5]:
                tr.write_line(f"        {i}")
            if len(ids) > 5:
                tr.write_line(f"        ... and {len(ids) - 5} more")
        bad = self.wrong()
        if bad and self.strict:
            tr.write_sep("!", f"{len(bad)} test(s) skipped for a wrong reason "
                              "(CLOUDTRAIN_STRICT_SKIPS=1)", red=True)
            for nodeid, reason, why in bad:
                tr.write_line(f"{nodeid}: '{reason}': {why}")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.strict and self.wrong() and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def register(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):      # an xdist worker: the controller counts
        return
    strict = os.environ.get("CLOUDTRAIN_STRICT_SKIPS") == "1"
    config.pluginmanager.register(SkipCheck(strict), "cloudtrain-skipcheck")
