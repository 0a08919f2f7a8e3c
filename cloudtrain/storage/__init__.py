"""Object storage the nodes use directly: bucket URLs (:mod:`cloudtrain.storage.url`), and the
laptop side of data mounts and checkpoints. The node side (the transfers themselves, with
rclone) is ``cloudtrain/node/ckpt.py``; see docs/storage.md."""

from cloudtrain.storage.url import BucketURL, BucketURLError, is_bucket_url, parse

__all__ = ["BucketURL", "BucketURLError", "is_bucket_url", "parse"]
