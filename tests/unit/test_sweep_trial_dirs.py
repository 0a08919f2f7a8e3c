"""A sweep trial's own folder and its outputs (docs/sweep.md, "Outputs: each trial's own
folder"): the copy of the synced workdir a trial's script makes (run here with bash), the
node's trial environment, the best trial's link, and what is read of the driver's document."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from cloudtrain.errors import RemoteError, UserError
from cloudtrain.node import sweepstudy, sweepwork
from cloudtrain.pipeline import sweepout
from cloudtrain.pipeline.sweepscript import own_workdir
from cloudtrain.schema import NodeRow
from cloudtrain.spec import parse_task


def test_the_trials_copy_leaves_out_the_outputs_links_the_mounts_and_copies_the_rest(
        tmp_path: Path) -> None:
    (tmp_path / "data.bin").write_text("d")
    task = parse_task("name: t\nworkdir: .\noutputs: [outputs/, ckpt/last.pt]\n"
                      "file_mounts: {data/train.bin: ./data.bin}\nrun: 'true'\n",
                      base_dir=tmp_path)
    src, trial = tmp_path / "root/workdir", tmp_path / "root/.cloudtrain/sweeps/s/trials/3"
    for rel, text in (("train.py", "code"), ("log.txt", "synced\n"), ("outputs/old.json", "x"),
                      ("ckpt/last.pt", "x"), ("ckpt/keep.txt", "k"), ("data/train.bin", "big")):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    trial.mkdir(parents=True)
    body = "\n".join(own_workdir(task)) + "\necho more >> log.txt; pwd\n"
    r = subprocess.run(["bash", "-c", body], capture_output=True, text=True, check=True,
                       env={**os.environ, "CLOUDTRAIN_TRIAL_DIR": str(trial),
                            "CLOUDTRAIN_SYNCED_WORKDIR": str(src)})
    work = trial / "work"
    assert r.stdout.strip() == str(work)
    assert (work / "train.py").read_text() == "code" and (work / "ckpt/keep.txt").exists()
    assert not (work / "outputs").exists() and not (work / "ckpt/last.pt").exists()
    assert (work / "data/train.bin").is_symlink()
    assert os.readlink(work / "data/train.bin") == str(src / "data/train.bin")
    # appended in place: the trial's copy only, never the synced workdir's file
    assert (work / "log.txt").read_text() == "synced\nmore\n"
    assert (src / "log.txt").read_text() == "synced\n"
    assert (work / "log.txt").stat().st_ino != (src / "log.txt").stat().st_ino


def test_the_node_gives_a_trial_its_folder_and_the_synced_workdir(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    folder = os.path.join(sweepstudy.sdir(root, "s"), "trials", "4")
    script = sweepwork.trial_script({"script": "env"}, "s", 4,
                                    os.path.join(folder, "metrics.jsonl"), {"lr": 0.1})
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    env = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    assert env["CLOUDTRAIN_TRIAL_DIR"] == folder
    assert env["CLOUDTRAIN_SYNCED_WORKDIR"] == os.path.join(root, "workdir")


def test_the_best_link_follows_the_best_and_never_replaces_a_folder(tmp_path: Path) -> None:
    (tmp_path / "trial-1").mkdir()
    (tmp_path / "trial-2").mkdir()
    assert sweepout.name_best(tmp_path, 1) == tmp_path / "trial-1"
    assert sweepout.name_best(tmp_path, 2) == tmp_path / "trial-2"
    assert os.readlink(tmp_path / "best") == "trial-2"
    assert sweepout.name_best(tmp_path, 5) is None        # not pulled: no link to it
    assert os.readlink(tmp_path / "best") == "trial-2"
    os.unlink(tmp_path / "best")
    (tmp_path / "best").mkdir()
    with pytest.raises(UserError, match="not the link cloudtrain makes"):
        sweepout.name_best(tmp_path, 1)


def test_only_ended_trials_with_whole_numbers_are_pulled() -> None:
    doc = {"trials_list": [{"number": 0, "state": "complete"}, {"number": 1, "state": "running"},
                           {"number": True, "state": "fail"}, {"number": "2", "state": "pruned"},
                           {"number": 3, "state": "pruned"}, "junk"],
           "best": {"number": 0}}
    assert sweepout.ended_and_best(doc) == ([0, 3], 0)
    assert sweepout.ended_and_best({"trials": [{"number": 4, "state": "fail"}], "best": 4}) \
        == ([4], 4)
    assert sweepout.ended_and_best({"trials": 12, "best": None}) == ([], None)


def test_an_earlier_sweeps_outputs_are_set_aside_never_overwritten(tmp_path: Path) -> None:
    top = tmp_path / "sweep-s"
    assert sweepout.set_aside(top) is None                 # nothing there
    top.mkdir()
    assert sweepout.set_aside(top) is None                 # empty: kept as it is
    (top / "trial-0").mkdir()
    (top / "trial-0" / "x").write_text("old")
    first = sweepout.set_aside(top)
    assert first is not None and (first / "trial-0" / "x").read_text() == "old"
    assert not top.exists() and first.name.startswith("sweep-s.")
    (top / "trial-0").mkdir(parents=True)
    second = sweepout.set_aside(top)
    assert second is not None and second != first and first.exists()


class _Said:
    """One node's answer, as remote.Group returns it."""

    def __init__(self, stdout: str, ok: bool = True) -> None:
        self.stdout, self.ok, self.stderr = stdout, ok, "" if ok else "no route"


class _Group:
    def __init__(self, said: dict[int, _Said]) -> None:
        self.said, self.commands = said, []

    def run(self, command, *, ranks, timeout):  # type: ignore[no-untyped-def]  # a stand-in
        self.commands += [command(n) for n in NODES if n.rank in ranks]
        return {r: self.said[r] for r in ranks}


NODES = [NodeRow("c", r, f"i{r}", "127.0.0.1", 22, "u", "10.0.0.1", "UP", f"root{r}")
         for r in (0, 1)]


def test_each_trial_is_pulled_from_the_node_that_holds_its_folder_read_as_untrusted() -> None:
    handle = SimpleNamespace(nodes=NODES)
    group = _Group({0: _Said("0\n1\njunk\n../x\n-3\n99999999999\n"), 1: _Said("2\n1\n")})
    got = sweepout.where_trials_ran(handle, group, "s")     # type: ignore[arg-type]
    assert {k: v.rank for k, v in got.items()} == {0: 0, 1: 0, 2: 1}
    assert "root1/.cloudtrain/sweeps/s/trials" in group.commands[1]
    assert f"head -c {sweepout.LIST_BYTES}" in group.commands[0]
    assert sweepout.trial_base(NODES[1], "s", 2) == "root1/.cloudtrain/sweeps/s/trials/2/work"
    with pytest.raises(RemoteError, match="node 1 did not list"):
        sweepout.where_trials_ran(handle, _Group({0: _Said("0"), 1: _Said("", ok=False)}),  # type: ignore[arg-type]
                                  "s")
