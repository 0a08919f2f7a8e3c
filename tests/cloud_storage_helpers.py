"""Shared by the storage-on-the-cloud-fakes and bucket-recovery tests (issue 13): a task that
reads a bucket file_mount and writes checkpoints, the emulator checks (who fetched, what
manifests landed), and the uninterrupted-run comparison the recovery tests make.

The AWS fake's machinery (moto server, local sshd nodes reached through ssh_proxy, the connection
guard) is reused from tests/providers/test_aws_cli.py, not copied."""

from __future__ import annotations

import json
from pathlib import Path

import storage_emulators as emus

CORPUS = ("the quick brown fox jumps over the lazy dog. " * 400).encode()

# A job body for any provider: both nodes read the bucket mount, write a checkpoint each into
# $CLOUDTRAIN_CHECKPOINT_DIR; the head's survives (it is the one uploaded).
RUN_BODY = (
    'set -e\n'
    'test -n "$CLOUDTRAIN_CHECKPOINT_DIR" || exit 9\n'
    'mkdir -p "$CLOUDTRAIN_CHECKPOINT_DIR"\n'
    'for s in 1 2; do\n'
    '  printf "rank %s step %s size %s\\n" "$CLOUDTRAIN_NODE_RANK" "$s" '
    '"$(wc -c < data/corpus.txt)" > "$CLOUDTRAIN_CHECKPOINT_DIR/step-00000$s.txt"\n'
    '  echo "$s" > "$CLOUDTRAIN_CHECKPOINT_DIR/latest"\n'
    '  sleep 1.5\n'
    'done\n'
    'echo "rank $CLOUDTRAIN_NODE_RANK read $(wc -c < data/corpus.txt) bytes"\n')


def object_gets(emu: emus.Emulator, key: str = "datasets/d1/corpus.txt") -> list[str]:
    """Requests that read an object's CONTENT (not listings or HEADs)."""
    lines = [ln for ln in emu.requests("/" + key) if "GET " in ln]
    if emu.kind == "gs":
        lines = [ln for ln in lines if "alt=media" in ln]
    return lines


def complete_manifests(emu: emus.Emulator, prefix: str) -> list[dict]:
    """The manifests under ``prefix``, oldest first, each checked: every object it names is in
    the bucket with the size it says."""
    keys = emu.keys(prefix)
    out = []
    for k in sorted(x for x in keys if x.startswith("manifests/")):
        man = json.loads(emu.cat(f"{prefix}/{k}"))
        for f in man["files"]:
            assert keys.get(f"objects/{f['sha256']}") == f["size"], (k, f, keys)
        out.append(man)
    return out


def result(proj: Path) -> dict:
    return json.loads((proj / "cloudtrain-outputs" / "outputs" / "result.json").read_text())


def losses(proj: Path) -> dict[int, float]:
    """The template's metrics: the last record of each step (steps redone after a resume
    overwrite earlier ones)."""
    out: dict[int, float] = {}
    for ln in (proj / "cloudtrain-outputs" / "outputs" / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(ln)
        if "loss" in rec and "step" in rec:
            out[int(rec["step"])] = float(rec["loss"])
    return out


def assert_like_uninterrupted(ref_proj: Path, got_proj: Path, steps: int,
                              head_lost: bool = False) -> dict:
    """The resumed run ends at the same step, at the same place in the data order and with the
    same losses as the uninterrupted one; returns the resumed run's result.json. When the head
    was lost, the metrics it had logged before went with its disk: then the resumed run's own
    steps (start_step+1 .. steps) must all be there, with the same losses."""
    ref, got = result(ref_proj), result(got_proj)
    assert ref["final_step"] == steps and ref["start_step"] == 0, ref
    assert got["final_step"] == ref["final_step"], (got, ref)
    assert got["final_position"] == ref["final_position"], (got, ref)     # same data order
    a, b = losses(ref_proj), losses(got_proj)
    want = list(range(got["start_step"] + 1, steps + 1)) if head_lost else sorted(a)
    assert len(a) == steps and sorted(b) == want, (a, b)
    for step in b:
        assert abs(b[step] - a[step]) <= 1e-6 + 1e-4 * abs(a[step]), (step, a[step], b[step])
    return got
