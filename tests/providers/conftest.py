"""The cloud fixtures the provider tests share: ``aws`` (moto, with the DLAMI images) and
``gcp`` (the GCE fake on loopback), each with a hermetic environment and a fresh cloudtrain
home. A test module that needs a different setup defines its own fixture of the same name."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

AWS_REGION = "us-east-1"


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    pytest.importorskip("moto")
    pytest.importorskip("boto3")
    from moto import mock_aws

    from aws_moto import Harness, add_images_to_moto, hermetic_env

    hermetic_env(monkeypatch)
    with mock_aws():
        add_images_to_moto(AWS_REGION)
        yield Harness(tmp_path / "home")


@pytest.fixture
def gcp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    pytest.importorskip("google.cloud.compute_v1")
    from cloudtrain.provider import registry
    from gce_fake import GCEFake, Harness, hermetic_env

    hermetic_env(monkeypatch, tmp_path)
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path / "home"))
    with GCEFake() as fake:
        fake.guard_env(monkeypatch)
        yield Harness(fake, tmp_path / "home")
        # nothing tried to leave loopback (google-auth's own boundary lookup aside)
        assert not [h for h in fake.outside if not h.startswith("iamcredentials.")], fake.outside
        registry.unregister_instance("gcp")
