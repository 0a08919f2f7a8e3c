"""The login node: where every Slurm command runs. ``local`` runs them on this machine (for
cloudtrain on the login node itself); ``user@host[:port]`` runs them there over ``ssh``, in
batch mode against the user's own known_hosts (a host key that does not match is refused as
``ssh`` refuses it; nothing is learned behind the user's back)."""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cloudtrain.errors import ProviderError, UserError

from cloudtrain_provisioners.slurm.options import login_host


@dataclass(frozen=True)
class Ran:
    """One command's result on the login node."""

    argv: tuple[str, ...]
    code: int
    out: str
    err: str

    @property
    def ok(self) -> bool:
        return self.code == 0

    def words(self) -> str:
        """What Slurm said, on one line (its stderr, else its stdout)."""
        text = (self.err.strip() or self.out.strip()).replace("\n", " ")
        return text[:600] or f"exit {self.code}"


@dataclass(frozen=True)
class Login:
    """How to run a command on the login node (``spec`` is the task's ``login``;
    ``identity_file`` the key to log in with, else ssh's defaults; ``known_hosts`` the
    cluster's own file, where a login node the user's known_hosts does not list is learned
    on first contact)."""

    spec: str = "local"
    identity_file: str | None = None
    known_hosts: Path | None = None

    @property
    def where(self) -> str:
        return "this machine" if self.spec == "local" else self.spec

    def argv(self, argv: list[str]) -> list[str]:
        if self.spec == "local":
            return argv
        h = login_host(self.spec)
        opts = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=20"]
        if self.known_hosts is not None:       # ours first: accept-new writes the first file
            files = f"{self.known_hosts} {Path('~/.ssh/known_hosts').expanduser()}"
            opts += ["-o", f"UserKnownHostsFile={files}", "-o", "StrictHostKeyChecking=accept-new"]
        else:
            opts += ["-o", "StrictHostKeyChecking=yes"]
        if self.identity_file:
            opts += ["-i", str(Path(self.identity_file).expanduser()), "-o", "IdentitiesOnly=yes"]
        return ["ssh", *opts, "-p", str(h.port), "-l", h.user, h.address, "--", shlex.join(argv)]

    def rsync_dest(self, path: str) -> str:
        """``path`` on the login node as rsync's destination."""
        if self.spec == "local":
            return path
        h = login_host(self.spec)
        return f"{h.user}@{h.address}:{path}"

    def rsync_shell(self) -> str:
        """rsync's ``-e``: ssh with this login's options (rsync adds the host)."""
        ssh = self.argv(["true"])
        return shlex.join(ssh[:ssh.index("-l")] + ssh[ssh.index("-l"):ssh.index("-l") + 2])

    def run(self, argv: list[str], stdin: str | None = None, timeout: float = 60) -> Ran:
        """Run ``argv`` there. A Slurm command missing on the login node is a UserError (exit
        2); a login node that cannot be reached is a ProviderError."""
        full = self.argv(argv)
        try:
            r = subprocess.run(full, input=stdin, capture_output=True, text=True,
                               timeout=timeout)
        except FileNotFoundError:
            raise self._missing(full[0]) from None
        except subprocess.TimeoutExpired:
            raise ProviderError(f"'{argv[0]}' on {self.where} did not answer in {timeout:g} s.",
                                "Check that the Slurm controller is up (sinfo), then run "
                                "the command again.") from None
        if self.spec != "local" and r.returncode == 255:
            said = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("@")]
            changed = "IDENTIFICATION HAS CHANGED" in r.stderr
            raise ProviderError(
                f"cannot reach the login node {self.spec} over SSH"
                + (": its host key is not the one pinned" if changed else "")
                + f" ({said[-1][:200] if said else 'ssh exit 255'}).",
                f"Check the login node's host key out of band; if it really changed, remove "
                f"the old one (ssh-keygen -R, in ~/.ssh/known_hosts or {self.known_hosts}) and "
                "run again." if changed else
                f"Check that 'ssh -p PORT USER@HOST' to {self.spec} works from here (your key "
                "loaded or resources.slurm.identity_file), then run again.")
        if r.returncode == 127:
            raise self._missing(argv[0])
        return Ran(tuple(argv), r.returncode, r.stdout, r.stderr)

    def _missing(self, prog: str) -> UserError:
        return UserError(f"'{prog}' is not installed on the login node ({self.where}).",
                         "Give resources.slurm.login the login node of a Slurm cluster (where "
                         "sbatch, squeue and scancel work), or install Slurm's client "
                         "commands there.")
