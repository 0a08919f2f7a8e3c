"""A real Slurm cluster for the tests, from Debian's packages, under a temp dir of its own.

``slurm_cluster`` (session scope) starts, per pytest process (each xdist worker has its own):
a private ``munged`` (its own key and socket), ``mariadbd`` + ``slurmdbd`` (so ``sacct``
works), ``slurmctld`` and two ``slurmd -N`` nodes, ``n1`` and ``n2``, each with 4 CPUs and 2
fake GPUs (``Gres=gpu:h100:2``, character devices made with mknod, so Slurm sets
CUDA_VISIBLE_DEVICES). Everything reads its own ``slurm.conf`` through ``SLURM_CONF``; the
machine's Slurm and munge configuration and any system ``munged`` are never used or touched.

The site, as the tests see it: partition ``gpu`` (default; both nodes; MaxTime 60 minutes,
limits enforced at submission), partition ``small`` (node n1 only), accounts ``root``
(root's default) and ``ctlab`` (root is a member), QOS ``normal`` and ``short`` (10 minutes
at most; a longer job pends forever), associations, limits and QOS enforced.

While the cluster lives, ``SLURM_CONF`` is set in this process's environment, so the CLI's
subprocesses (and the ``cli`` fixture's closing ``down -a``) reach this cluster. At the end
every job is cancelled, ``scontrol shutdown`` stops the controller and the nodes, the step
daemons and tasks that survive it are found by our ``SLURM_CONF`` in their environment and
killed, then slurmdbd, mariadbd and munged are stopped and the temp dir removed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

DAEMONS = ("munged", "mariadbd", "mariadb-install-db", "slurmdbd", "slurmctld", "slurmd",
           "sbatch", "sacctmgr")
NODES = ("n1", "n2")
CPUS_PER_NODE = 4
GPUS_PER_NODE = 2
ACCOUNT = "ctlab"
PARTITION_MAX_MINUTES = 60
SHORT_QOS = "short"
SHORT_QOS_MINUTES = 10


def missing() -> list[str]:
    """The Slurm/munge/MariaDB programs this machine lacks ([] : the cluster can start)."""
    return [d for d in DAEMONS if shutil.which(d) is None
            and not Path("/usr/sbin", d).exists() and not Path("/usr/bin", d).exists()]


def _why_not() -> str:
    """Why no test cluster can start here ("": it can). As root, missing packages are a
    setup failure, not a reason to skip (tests/skipcheck.py fails a strict run on it)."""
    if os.geteuid() != 0:
        return "a test Slurm cluster needs root (its daemons and mknod'ed device files)"
    if missing():
        return ("the Slurm packages are missing: " + " ".join(missing())
                + " (bash scripts/setup.sh --tests installs them)")
    return ""


needs_slurm = pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "-")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prog(name: str) -> str:
    return shutil.which(name) or str(next(p for p in (Path("/usr/sbin", name),
                                                        Path("/usr/bin", name)) if p.exists()))


@dataclass
class SlurmCluster:
    """A running test cluster: its files under ``root``, its ``conf`` (slurm.conf)."""

    root: Path
    name: str = "ct"
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "run" / "munge.sock"

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *args: str, check: bool = True, timeout: float = 60
            ) -> subprocess.CompletedProcess[str]:
        """A Slurm client command (sinfo, squeue, sbatch, sacct, ...) against this cluster."""
        r = subprocess.run(list(args), capture_output=True, text=True, env=self.env(),
                           timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: exit {r.returncode}\n{r.stdout}{r.stderr}")
        return r

    def jobs(self) -> list[dict[str, str]]:
        """squeue's jobs: id, name, state, reason, nodes."""
        out = self.run("squeue", "-h", "-o", "%i|%j|%T|%r|%N").stdout
        return [dict(zip(("id", "name", "state", "reason", "nodes"), line.split("|")))
                for line in out.splitlines() if line.strip()]

    def wait_idle(self, timeout: float = 60) -> None:
        """Until both nodes are idle (no job holds them)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = self.run("sinfo", "-h", "-N", "-p", "gpu", "-o", "%N %t",
                           check=False).stdout.split()
            if out and out == [x for n in NODES for x in (n, "idle")]:
                return
            time.sleep(0.5)
        raise AssertionError(f"the nodes are not idle after {timeout} s: "
                             + self.run("sinfo", "-N", check=False).stdout + self.logs())

    def cancel_all(self, timeout: float = 30) -> None:
        ids = [j["id"] for j in self.jobs()]
        if ids:
            self.run("scancel", *ids, check=False)
        deadline = time.time() + timeout
        while self.jobs() and time.time() < deadline:
            time.sleep(0.3)

    def logs(self, tail: int = 30) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*.log")):
            lines = f.read_text(errors="replace").splitlines()[-tail:]
            out.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(out)

    # --- starting -----------------------------------------------------------------------

    def write_files(self) -> None:
        r = self.root
        for d in ("etc", "run", "log", "state", "dev", "db", *(f"spool/{n}" for n in NODES)):
            (r / d).mkdir(parents=True, exist_ok=True)
        r.chmod(0o755)                      # munged: every dir above its socket executable
        (r / "run").chmod(0o755)
        keydir = r / "munge"
        keydir.mkdir(mode=0o700, exist_ok=True)
        key = keydir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for i in range(GPUS_PER_NODE):
            dev = r / "dev" / f"nvidia{i}"
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))   # a char device (/dev/null's)
        self.ports = {"ctld": _free_port(), "dbd": _free_port(), "db": _free_port(),
                      **{n: _free_port() for n in NODES}}
        host = socket.gethostname()
        sock = self.munge_socket
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={self.ports[n]} "
            f"CPUs={CPUS_PER_NODE} RealMemory=1000 Gres=gpu:h100:{GPUS_PER_NODE} State=UNKNOWN"
            for n in NODES)
        self.conf.write_text(f"""\
ClusterName={self.name}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={self.ports['ctld']}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
GresTypes=gpu
KillWait=5
MinJobAge=60
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={self.ports['dbd']}
AccountingStoragePass={sock}
AccountingStorageTRES=gres/gpu
AccountingStorageEnforce=associations,limits,qos
EnforcePartLimits=ALL
{nodes}
PartitionName=gpu Nodes=n[1-2] Default=YES MaxTime={PARTITION_MAX_MINUTES} State=UP
PartitionName=small Nodes=n1 MaxTime={PARTITION_MAX_MINUTES} State=UP
""")
        (r / "etc" / "gres.conf").write_text(
            f"NodeName=n[1-2] Name=gpu Type=h100 File={r}/dev/nvidia[0-{GPUS_PER_NODE - 1}]\n")
        dbd = r / "etc" / "slurmdbd.conf"
        dbd.write_text(f"""\
AuthType=auth/munge
AuthInfo=socket={sock}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={self.ports['dbd']}
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={self.ports['db']}
StorageUser=slurm
StoragePass=ct-test
StorageLoc=slurm_acct_db
LogFile={r}/log/slurmdbd.log
PidFile={r}/run/slurmdbd.pid
""")
        dbd.chmod(0o600)

    def _spawn(self, key: str, *argv: str) -> None:
        log = open(self.root / "log" / f"{key}.out", "ab")   # noqa: SIM115 - the daemon keeps it
        self.procs[key] = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                                           env=self.env(), start_new_session=True,
                                           cwd=self.root)

    def _until(self, what: str, pred: object, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if pred():  # type: ignore[operator]
                return
            dead = [k for k, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}\n"
                                   + self.logs())
            time.sleep(0.3)
        raise RuntimeError(f"timed out waiting for {what}\n" + self.logs())

    def start(self) -> None:
        r = self.root
        self.write_files()
        self._spawn("munged", _prog("munged"), "-F", f"--key-file={r}/munge/munge.key",
                    f"--socket={self.munge_socket}", f"--pid-file={r}/run/munged.pid",
                    f"--log-file={r}/log/munged.log", f"--seed-file={r}/munge/seed")
        self._until("munged", self.munge_socket.exists, 20)
        db = r / "db"
        subprocess.run([_prog("mariadb-install-db"), "--no-defaults", f"--datadir={db}",
                        "--user=root", "--auth-root-authentication-method=socket",
                        "--skip-test-db"], check=True, capture_output=True, timeout=120)
        dbsock = r / "run" / "mariadb.sock"
        self._spawn("mariadbd", _prog("mariadbd"), "--no-defaults", f"--datadir={db}",
                    f"--socket={dbsock}", f"--port={self.ports['db']}",
                    "--bind-address=127.0.0.1", "--user=root", f"--pid-file={r}/run/mariadb.pid",
                    f"--log-error={r}/log/mariadb.log", "--skip-name-resolve",
                    "--innodb-lock-wait-timeout=900")
        self._until("mariadbd", dbsock.exists, 60)
        sql = ("CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'ct-test';"
               "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';")
        subprocess.run([shutil.which("mariadb") or "mysql", "--no-defaults",
                        f"--socket={dbsock}", "-uroot", "-e", sql],
                       check=True, capture_output=True, timeout=60)
        self._spawn("slurmdbd", _prog("slurmdbd"), "-D")
        self._until("slurmdbd to add the cluster", lambda: self.run(
            "sacctmgr", "-i", "add", "cluster", self.name, check=False, timeout=20
        ).returncode == 0, 60)
        self.run("sacctmgr", "-i", "add", "account", ACCOUNT, f"cluster={self.name}")
        self.run("sacctmgr", "-i", "add", "user", "root", f"account={ACCOUNT}",
                 f"cluster={self.name}")
        # a QOS whose wall-time limit queues longer jobs forever (no DenyOnLimit): they pend
        # with reason QOSMaxWallDurationPerJobLimit
        self.run("sacctmgr", "-i", "add", "qos", SHORT_QOS, f"MaxWall={SHORT_QOS_MINUTES}")
        self.run("sacctmgr", "-i", "modify", "user", "root", "set", f"qos+={SHORT_QOS}")
        self._spawn("slurmctld", _prog("slurmctld"), "-D", "-i")
        for n in NODES:
            self._spawn(f"slurmd-{n}", _prog("slurmd"), "-D", "-N", n)
        self.wait_idle(timeout=90)

    # --- stopping -----------------------------------------------------------------------

    def leftovers(self) -> list[int]:
        """This cluster's step daemons (slurmstepd) and job tasks (SLURM_JOB_ID set): found by
        our SLURM_CONF in their environment. Other processes that merely inherited it (a CLI
        run by a test, a test's sshd) are not counted."""
        needle = f"SLURM_CONF={self.conf}".encode() + b"\0"
        ours = {p.pid for p in self.procs.values()} | {os.getpid()}
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in ours:
                continue
            try:
                env = b"\0" + (entry / "environ").read_bytes() + b"\0"
                argv0 = (entry / "cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if needle in env and (b"\0SLURM_JOB_ID=" in env or argv0.endswith(b"slurmstepd")
                                  or argv0.startswith(b"slurmstepd")):
                found.append(int(entry.name))
        return found

    def stop(self) -> None:
        try:
            if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
                self.cancel_all()
                self.run("scontrol", "shutdown", check=False, timeout=30)
        finally:
            for key in ("slurmctld", *(f"slurmd-{n}" for n in NODES)):
                _end(self.procs.get(key), 20)
            for pid in self.leftovers():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for key in ("slurmdbd", "mariadbd", "munged"):
                _end(self.procs.get(key), 30)
            shutil.rmtree(self.root, ignore_errors=True)


def _end(proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """SIGTERM one daemon we started (waited for), SIGKILL after ``timeout`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """One real Slurm cluster per pytest process (per xdist worker), started on first use."""
    if _why_not():
        pytest.skip(_why_not())
    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="ct-slurm-")))
    before = os.environ.get("SLURM_CONF")
    try:
        cluster.start()
        os.environ["SLURM_CONF"] = str(cluster.conf)
        yield cluster
    finally:
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
        cluster.stop()


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The session's cluster with no job queued before and after the test."""
    slurm_cluster.cancel_all()
    yield slurm_cluster
    slurm_cluster.cancel_all()
