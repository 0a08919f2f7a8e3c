"""The ``aws`` provider: EC2 instances in a cluster's own security group, found again by tag.

Install with ``pip install 'cloudtrain[aws]'``. Credentials come from boto3's standard chain
(environment, ``AWS_PROFILE``/``CLOUDTRAIN_AWS_PROFILE``, ``~/.aws``, SSO, instance roles)
and never leave this machine. boto3 is imported only when the provider first calls AWS.

Modules: ``provider`` (the contract, placement and failover), ``api`` (client factory,
error classification, retries), ``network`` (security group, key pair, placement group),
``images`` (instance type facts, Deep Learning AMI lookup), ``instances`` (launch, wait,
host keys), ``teardown`` (removal by tag, gc), ``tags`` (the marks), ``options``
(``resources.aws``). The test doubles (what moto lacks, fault injection) are in the tests:
tests/fakes/aws_moto.py. See docs/aws.md.
"""

from __future__ import annotations

from .options import AWSOptions
from .provider import AWSProvider

__all__ = ["AWSOptions", "AWSProvider"]
