"""The ``slurm`` provider: a cluster is one allocation on a Slurm cluster the user already
has (see :mod:`cloudtrain_provisioners.slurm.provider` and docs/slurm.md)."""

from cloudtrain_provisioners.slurm.provider import SlurmProvider

__all__ = ["SlurmProvider"]
