"""Helpers shared by the benchmark scripts (stdlib only; no cloudtrain import here).

Every script runs ``cloudtrain`` against its own temporary CLOUDTRAIN_HOME, so nothing it
creates can be mistaken for (or touch) the user's clusters, and everything it starts can be
found again and torn down from that home.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
import tempfile
from typing import Callable, Iterator, Sequence, TypeVar

T = TypeVar("T")


# --- which cloudtrain to run -------------------------------------------------------------------

def real_script() -> str | None:
    """The console script installed next to this interpreter (no pyenv shim in front of it)."""
    for scripts in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        if not scripts:
            continue
        cand = os.path.join(scripts, "cloudtrain")
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def cloudtrain_cmd() -> list[str]:
    """The command the benchmarks run: the real console script, else ``python -m cloudtrain``."""
    s = real_script()
    return [s] if s else [sys.executable, "-m", "cloudtrain"]


# --- statistics --------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank-with-interpolation percentile (q in 0..100) of a non-empty sequence."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain, aligned text table (first column left-aligned, the others right-aligned)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


# --- machine description -----------------------------------------------------------------------

def machine_line() -> str:
    import platform

    try:
        ssh = subprocess.run(["ssh", "-V"], capture_output=True, text=True, timeout=5).stderr.strip()
        ssh = ssh.split(",")[0]
    except (OSError, subprocess.SubprocessError):
        ssh = "ssh ?"
    try:
        load = "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        load = ""
    return (f"{os.cpu_count()} CPU(s), Python {platform.python_version()}, {ssh}, "
            f"{platform.system()} {platform.release()}, {load}")


# --- temp homes, teardown, and signals -----------------------------------------------------------

def sigterm_as_interrupt() -> None:
    """SIGTERM behaves like Ctrl-C, so the ``finally`` teardown runs for both."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


class _Shielded:
    """Ignore SIGINT/SIGTERM while tearing down, so a second Ctrl-C cannot stop it halfway."""

    def __enter__(self) -> None:
        self.prev = (signal.signal(signal.SIGINT, signal.SIG_IGN),
                     signal.signal(signal.SIGTERM, signal.SIG_IGN))

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self.prev[0])
        signal.signal(signal.SIGTERM, self.prev[1])


def ct_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["CLOUDTRAIN_HOME"] = str(home)
    env["NO_COLOR"] = "1"
    env.pop("CLOUDTRAIN_SSH_TIMEOUT", None)
    return env


def sshd_pids_under(root: Path) -> list[int]:
    """sshd processes whose command line names a config under ``root`` (i.e. that we started)."""
    needle = str(root).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"sshd_config" in cmd and needle in cmd:
            found.append(int(entry.name))
    return found


def teardown(home: Path, root: Path, keep_files: bool = False) -> None:
    """``cloudtrain down -a -y`` for this home; then make sure no sshd of ours is left (killing
    any straggler by pid) and remove the temp root. Never raises."""
    with _Shielded():
        try:
            if home.exists():
                proc = subprocess.run(cloudtrain_cmd() + ["down", "-a", "-y"], env=ct_env(home),
                                      capture_output=True, text=True, timeout=300)
                if proc.returncode != 0:
                    print(f"[bench] 'cloudtrain down -a -y' exited {proc.returncode}:\n"
                          f"{proc.stdout}{proc.stderr}", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - keep going: the pid sweep below still runs
            print(f"[bench] teardown failed: {exc}", file=sys.stderr)
        left = sshd_pids_under(root)
        if left:
            print(f"[bench] killing sshd left after teardown: {left}", file=sys.stderr)
            for p in left:
                try:
                    os.kill(p, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.2)
        if not keep_files:
            shutil.rmtree(root, ignore_errors=True)
        still = sshd_pids_under(root)
        if still:
            print(f"[bench] WARNING: sshd still running from {root}: {still}", file=sys.stderr)


def down(home: Path, name: str) -> None:
    """Tear one cluster down (errors reported, not raised)."""
    try:
        with _Shielded():
            proc = subprocess.run(cloudtrain_cmd() + ["down", name, "-y"], env=ct_env(home),
                                  capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"[bench] 'cloudtrain down {name}' failed: {exc}", file=sys.stderr)
        return
    if proc.returncode != 0:
        print(f"[bench] 'cloudtrain down {name}' exited {proc.returncode}:\n"
              f"{proc.stdout}{proc.stderr}", file=sys.stderr)


def begin(prefix: str, title: str) -> tuple[Path, Path]:
    """Start a benchmark: SIGTERM acts as Ctrl-C, a fresh temp root with its CLOUDTRAIN_HOME,
    and the header lines every script prints. Returns (root, home)."""
    sigterm_as_interrupt()
    root = Path(tempfile.mkdtemp(prefix=prefix))
    home = root / "home"
    print(f"# {title}")
    print(f"# machine: {machine_line()}")
    print(f"# cloudtrain: {' '.join(cloudtrain_cmd())}; CLOUDTRAIN_HOME={home}")
    return root, home


def run_counts(root: Path, home: Path, counts: Sequence[int], per_count: Callable[[int], T],
               cluster_of: Callable[[int], str], keep_files: bool = False,
               prepare: Callable[[], None] | None = None) -> tuple[list[T], bool]:
    """Run ``per_count(n)`` for each node count, tearing each count's cluster down after it and
    everything at the end, on Ctrl-C and SIGTERM too. Returns (results, interrupted)."""
    results: list[T] = []
    interrupted = False
    try:
        if prepare is not None:
            prepare()
        for n in counts:
            try:
                results.append(per_count(n))
            finally:
                down(home, cluster_of(n))
    except KeyboardInterrupt:
        interrupted = True
        print("\n[bench] interrupted: tearing everything down...", file=sys.stderr, flush=True)
    finally:
        t = time.monotonic()
        teardown(home, root, keep_files=keep_files)
        print(f"# teardown done in {time.monotonic() - t:.1f} s", flush=True)
    return results, interrupted


def timed_lines(cmd: list[str], env: dict[str, str], cwd: Path | None = None,
                timeout: float = 600) -> tuple[int, float, float, list[tuple[float, str]]]:
    """Run ``cmd``; return (exit code, wall-clock start, wall-clock end, [(t, line)]) where each
    output line (stdout and stderr merged) carries the wall-clock time it was read at."""
    lines: list[tuple[float, str]] = []
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            lines.append((time.time(), raw.decode(errors="replace").rstrip("\n")))
        code = proc.wait(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    t1 = time.time()
    return code, t0, t1, lines


def iter_csv_ints(text: str) -> Iterator[int]:
    for part in text.split(","):
        part = part.strip()
        if part:
            yield int(part)
