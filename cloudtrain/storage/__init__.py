"""Object storage the nodes use directly: bucket URLs (:mod:`cloudtrain.storage.url`). The
laptop side of mounts and checkpoints is :mod:`cloudtrain.pipeline.storage`; the node side
(the transfers themselves, with rclone) is ``cloudtrain/node/store.py``; see docs/storage.md."""

from cloudtrain.storage.url import BucketURL, BucketURLError, is_bucket_url, parse

__all__ = ["BucketURL", "BucketURLError", "is_bucket_url", "parse"]
