"""Bucket URLs (cloudtrain/storage/url.py): each naming rule, good and bad, and through the real
CLI a bad ``checkpoints:`` or bucket file_mounts source is refused with exit 2, a message naming
the field, and nothing created. Also the node side's view of the same URLs (store.py's
parse_url and the rclone remote it builds from environment variables only)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from cloudtrain.node import store
from cloudtrain.storage import url as bucket_url

GOOD = [
    ("s3://my-bucket", ("s3", "my-bucket", "", "", "")),
    ("s3://my.bucket-1/run/1/", ("s3", "my.bucket-1", "run/1", "", "")),
    ("gs://my_bucket/ckpt", ("gs", "my_bucket", "ckpt", "", "")),
    ("https://acct1.blob.core.windows.net/ckpts/run-1", ("az", "ckpts", "run-1", "acct1", "")),
    ("http://127.0.0.1:10000/devstoreaccount1/ckpts/a",
     ("az", "ckpts", "a", "devstoreaccount1", "http://127.0.0.1:10000")),
    # Close to a reserved word, but allowed by the clouds' rules.
    ("s3://sthree/x", ("s3", "sthree", "x", "", "")),
    ("s3://my-xn--b/x", ("s3", "my-xn--b", "x", "", "")),
    ("s3://s3alias-data", ("s3", "s3alias-data", "", "", "")),
    ("gs://go-og/x", ("gs", "go-og", "x", "", "")),
    ("gs://" + "a" * 63 + "." + "b" * 63, ("gs", "a" * 63 + "." + "b" * 63, "", "", "")),
]

BAD = [
    ("", "empty"),
    ("s3://My-Bucket/x", "not a valid S3 bucket"),
    ("s3://ab", "not a valid S3 bucket"),
    ("s3://192.168.1.1/x", "not a valid S3 bucket"),
    ("s3://a..b/x", "not a valid S3 bucket"),
    ("gs://-bad/x", "not a valid GCS bucket"),
    ("s3://bucket/a/../b", "'..' segment"),
    ("s3://bucket/a//b", "empty path segment"),
    ("s3://bucket/a b", "spaces"),
    ("s3://bucket/x?versionId=1", "'?' or '#'"),
    ("s3://key:secret@bucket/x", "carries credentials"),
    ("https://example.com/c/p", "not a bucket URL cloudtrain knows"),
    ("https://acct1.blob.core.windows.net/Bad_Container/x", "not a valid Azure container"),
    ("https://acct1.blob.core.windows.net/a--b/x", "not a valid Azure container"),
    ("http://10.0.0.5:10000/devstoreaccount1/c1/x", "only for a storage emulator"),
    ("http://127.0.0.1:10000/Dev/c1/x", "not a valid storage account"),
    ("az://acct/c/x", "write Azure Blob URLs as"),
    ("ftp://bucket/x", "not a bucket URL"),
    ("file:///etc/passwd", "not a bucket URL"),
    ("s3://my-bucket//x", "empty path segment"),
    ("s3://my-bucket/x//", "empty path segment"),
    ("https://acct1.blob.core.windows.net//c1/x", "not a valid Azure container"),
    ("s3://xn--data/x", "S3 reserves names starting 'xn--'"),
    ("s3://sthree-configurator", "S3 reserves names starting 'sthree-'"),
    ("s3://x-s3alias", "S3 reserves names ending '-s3alias'"),
    ("s3://x--ol-s3", "S3 reserves names ending '--ol-s3'"),
    ("s3://x.mrap", "S3 reserves names ending '.mrap'"),
    ("s3://x--x-s3", "S3 reserves names ending '--x-s3'"),
    ("gs://goog", "GCS reserves names starting 'goog'"),
    ("gs://a-google-b", "'google'"),
    ("gs://a-go0g1e-b", "'google'"),
    ("gs://" + "a" * 64, "at most 63"),
    ("gs://" + "a" * 64 + ".b", "longer than 63"),
    ("gs://" + ".".join(["a" * 60] * 4), "not a valid GCS bucket"),
]


@pytest.mark.parametrize("text,want", GOOD, ids=[g[0][:60] for g in GOOD])
def test_good_urls_parse_and_round_trip(text: str, want: tuple[str, ...]) -> None:
    u = bucket_url.parse(text)
    assert (u.scheme, u.bucket, u.prefix, u.account, u.endpoint) == want
    assert bucket_url.parse(str(u)) == u
    # The node side reads the same parts from the same text.
    n = store.parse_url(str(u))
    assert (n["scheme"], n["bucket"], n["prefix"]) == (u.scheme, u.bucket, u.prefix)


@pytest.mark.parametrize("text,says", BAD, ids=[b[0][:60] or "empty" for b in BAD])
def test_bad_urls_are_refused_with_the_rule(text: str, says: str) -> None:
    with pytest.raises(bucket_url.BucketURLError) as e:
        bucket_url.parse(text)
    assert says in str(e.value)


def test_child_checks_each_segment() -> None:
    u = bucket_url.parse("s3://bkt/run")
    assert str(u.child("manifests", "x.json")) == "s3://bkt/run/manifests/x.json"
    with pytest.raises(bucket_url.BucketURLError):
        u.child("..", "etc")


def test_node_side_rejects_escaping_urls() -> None:
    for text in ("s3://bkt/../x", "http://10.1.2.3:1/acct/c", "file:///etc"):
        with pytest.raises(store.StoreError):
            store.parse_url(text)


def test_rclone_remote_comes_from_environment_only() -> None:
    base = {"PATH": "/usr/bin", "AWS_CA_BUNDLE": "/x.pem", "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
            "AWS_REGION": "eu-west-1", "RCLONE_CONFIG_CTS_STALE": "1"}
    env = store.rclone_env(store.parse_url("s3://bkt/p"), base)
    assert "AWS_CA_BUNDLE" not in env and "RCLONE_CONFIG_CTS_STALE" not in env
    assert env["RCLONE_CONFIG_CTS_TYPE"] == "s3" and env["RCLONE_CONFIG_CTS_ENV_AUTH"] == "true"
    assert env["RCLONE_CONFIG_CTS_PROVIDER"] == "Other"
    assert env["RCLONE_CONFIG_CTS_ENDPOINT"] == "http://127.0.0.1:9"
    assert env["RCLONE_CONFIG_CTS_REGION"] == "eu-west-1"
    env = store.rclone_env(store.parse_url("s3://bkt/p"), {"PATH": "/usr/bin"})
    assert env["RCLONE_CONFIG_CTS_PROVIDER"] == "AWS" and "RCLONE_CONFIG_CTS_ENDPOINT" not in env
    env = store.rclone_env(store.parse_url("gs://bkt/p"), {})
    assert env["RCLONE_CONFIG_CTS_ENV_AUTH"] == "true" and "RCLONE_CONFIG_CTS_ANONYMOUS" not in env
    env = store.rclone_env(store.parse_url("gs://bkt/p"), {"STORAGE_EMULATOR_HOST": "127.0.0.1:9"})
    assert env["RCLONE_CONFIG_CTS_ENDPOINT"] == "http://127.0.0.1:9"
    # Azure: a key when given (never on a command line), else the managed identity.
    az = store.parse_url("https://acct1.blob.core.windows.net/c1/p")
    assert store.rclone_env(az, {})["RCLONE_CONFIG_CTS_USE_MSI"] == "true"
    env = store.rclone_env(az, {"AZURE_STORAGE_CONNECTION_STRING": "AccountName=acct1;AccountKey=a2V5"})
    assert env["RCLONE_CONFIG_CTS_KEY"] == "a2V5" and "RCLONE_CONFIG_CTS_USE_MSI" not in env
    emu = store.parse_url("http://127.0.0.1:10000/devstoreaccount1/c1/p")
    with pytest.raises(store.StoreError):
        store.rclone_env(emu, {})     # no well-known key is hard-wired
    sas = store.rclone_env(emu, {"AZURE_STORAGE_KEY": "a2V5"})["RCLONE_CONFIG_CTS_SAS_URL"]
    assert sas.startswith("http://127.0.0.1:10000/devstoreaccount1?") and "sig=" in sas


# --- through the CLI ---------------------------------------------------------------------------

def _created(home: Path) -> list[str]:
    found = [str(p) for p in (home / "clusters").rglob("*")] if (home / "clusters").exists() else []
    if (home / "state.db").exists():
        with sqlite3.connect(home / "state.db") as conn:
            found += [r[0] for r in conn.execute("SELECT name FROM clusters").fetchall()]
    return found


@pytest.mark.parametrize("snippet,field", [
    ("checkpoints: s3://Bad_Bucket/run\n", "checkpoints"),
    ("checkpoints: ftp://bucket/run\n", "checkpoints"),
    ("checkpoints: s3://bucket/a/../b\n", "checkpoints"),
    ("file_mounts:\n  data: gs://-nope/x\n", "file_mounts"),
    ("file_mounts:\n  data: http://10.0.0.1:10000/acct/c1/x\n", "file_mounts"),
], ids=["ckpt-bucket-name", "ckpt-scheme", "ckpt-dotdot", "mount-gs-name", "mount-az-not-loopback"])
def test_cli_refuses_bad_bucket_fields(snippet: str, field: str, tmp_path: Path) -> None:
    home = tmp_path / "home"
    task = tmp_path / "task.yaml"
    task.write_text("num_nodes: 1\nrun: echo hi\n" + snippet)
    env = {**os.environ, "CLOUDTRAIN_HOME": str(home), "NO_COLOR": "1"}
    for cmd in (("launch", str(task), "-y"), ("up", "--dry-run", str(task))):
        r = subprocess.run([sys.executable, "-m", "cloudtrain", *cmd], capture_output=True,
                           text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "Traceback" not in r.stderr and r.stderr.startswith("error: "), r.stderr
        assert f"'{field}" in r.stderr, r.stderr
        assert _created(home) == [], r.stderr
