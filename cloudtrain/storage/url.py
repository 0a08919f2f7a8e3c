"""Bucket URLs in a task (``file_mounts`` sources, ``checkpoints:``), parsed and checked.

A bucket URL names a place in object storage the NODES read from or write to directly (never
through the laptop). Three forms:

- ``s3://BUCKET[/PREFIX]`` (AWS S3, or any S3-compatible store the nodes' environment points
  at with ``AWS_ENDPOINT_URL``);
- ``gs://BUCKET[/PREFIX]`` (Google Cloud Storage);
- ``https://ACCOUNT.blob.core.windows.net/CONTAINER[/PREFIX]`` (Azure Blob), or the emulator
  form ``http://127.0.0.1:PORT/ACCOUNT/CONTAINER[/PREFIX]`` (loopback only, for Azurite).

Every part is checked here, before anything is created: a bucket/container/account name by
its cloud's own naming rules, a prefix without ``..``, empty or control-character segments.
The parsed value is what IAM policies, rclone remotes and log lines are built from, so nothing
the user typed reaches them unchecked. Pure stdlib: the node side imports nothing from here.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Iterable, Literal
from urllib.parse import urlsplit

Scheme = Literal["s3", "gs", "az"]
CLOUD_OF: dict[Scheme, Literal["aws", "gcp", "azure"]] = {"s3": "aws", "gs": "gcp", "az": "azure"}
"""The provider whose identities can be granted access to a bucket of each scheme."""

MAX_PREFIX = 1024          # object key prefix, bytes (S3 and GCS keys are at most 1024)
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_GS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
_AZ_CONTAINER = re.compile(r"^(?!.*--)[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")
_AZ_ACCOUNT = re.compile(r"^[a-z0-9]{3,24}$")
_AZ_HOST = re.compile(r"^([a-z0-9]{3,24})\.blob\.core\.windows\.net$")
_SEGMENT_BAD = re.compile(r"[\x00-\x1f\x7f\\]")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*://")

# Names S3 reserves (AWS's general purpose bucket naming rules): prefixes and suffixes.
S3_RESERVED_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
S3_RESERVED_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")
# GCS refuses names containing "google" or a close misspelling ("g00gle"): the look-alike
# digits are read as the letters they stand for before the check.
_GS_LOOKALIKE = str.maketrans({"0": "o", "1": "l", "3": "e", "9": "g"})


class BucketURLError(ValueError):
    """A bucket URL that cannot be used; the message names what is wrong and how to write it."""


@dataclass(frozen=True)
class BucketURL:
    scheme: Scheme
    bucket: str
    """The S3/GCS bucket, or the Azure container."""
    prefix: str = ""
    """Key prefix inside the bucket, without leading or trailing '/' ("" for the whole bucket)."""
    account: str = ""
    """Azure: the storage account."""
    endpoint: str = ""
    """Azure emulator only: ``http://127.0.0.1:PORT`` (empty for the real service)."""

    def __str__(self) -> str:
        tail = f"/{self.prefix}" if self.prefix else ""
        if self.scheme == "az":
            if self.endpoint:
                return f"{self.endpoint}/{self.account}/{self.bucket}{tail}"
            return f"https://{self.account}.blob.core.windows.net/{self.bucket}{tail}"
        return f"{self.scheme}://{self.bucket}{tail}"

    @property
    def cloud(self) -> Literal["aws", "gcp", "azure"]:
        """The provider whose identities can be granted access to this bucket."""
        return CLOUD_OF[self.scheme]

    def child(self, *parts: str) -> BucketURL:
        """This URL with ``parts`` appended to the prefix (each part checked as a segment)."""
        segs = [s for s in self.prefix.split("/") if s]
        for p in parts:
            for s in p.split("/"):
                if s:
                    _check_segment(s, _shown(str(self)))
                    segs.append(s)
        return BucketURL(self.scheme, self.bucket, "/".join(segs), self.account, self.endpoint)


def of_scheme(buckets: Iterable[BucketURL], scheme: Scheme) -> list[BucketURL]:
    """The buckets of one scheme (``s3``, ``gs``, ``az``), each once, in order."""
    out: list[BucketURL] = []
    for b in buckets:
        if b.scheme == scheme and b not in out:
            out.append(b)
    return out


def is_bucket_url(text: str) -> bool:
    """Whether ``text`` is meant as a URL (``SCHEME://...``), not a local path: it may still be
    an invalid one (``file:///etc``, ``ftp://x``: :func:`parse` refuses every scheme but the
    bucket ones)."""
    return bool(_SCHEME.match(text.strip().lower()))


def parse(text: str) -> BucketURL:
    """Parse and check a bucket URL; BucketURLError (a ValueError) says what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise BucketURLError("the bucket URL is empty; write e.g. s3://my-bucket/checkpoints")
    raw = text.strip()
    shown = _shown(raw)
    if any(c.isspace() for c in raw) or _SEGMENT_BAD.search(raw):
        raise BucketURLError(f"'{shown}' contains spaces or control characters; "
                             "write e.g. s3://my-bucket/run-1")
    parts = urlsplit(raw)
    scheme = parts.scheme.lower()
    if parts.query or parts.fragment:
        raise BucketURLError(f"'{shown}' has a '?' or '#' part; give only the bucket and "
                             "prefix, e.g. s3://my-bucket/run-1 (credentials come from the "
                             "nodes' identity or the task's envs, never from the URL)")
    if "@" in parts.netloc:
        raise BucketURLError(f"'{shown}' carries credentials; remove them (and change them: "
                             "they were written in a file): the nodes get access from their "
                             "cloud identity or the task's envs")
    if scheme == "s3" or scheme == "gs":
        bucket = parts.netloc
        problem = (s3_name_problem if scheme == "s3" else gs_name_problem)(bucket)
        if problem:
            raise BucketURLError(
                f"'{bucket[:80]}' is not a valid {'S3' if scheme == 's3' else 'GCS'} bucket "
                f"name: {problem}; e.g. {scheme}://my-bucket/run-1")
        return BucketURL("s3" if scheme == "s3" else "gs", bucket, _prefix(parts.path, shown))
    if scheme == "https":
        m = _AZ_HOST.match(parts.netloc.lower())
        if not m or parts.netloc != parts.netloc.lower():
            raise BucketURLError(
                f"'{shown}' is not a bucket URL cloudtrain knows: use s3://BUCKET/PREFIX, "
                "gs://BUCKET/PREFIX or https://ACCOUNT.blob.core.windows.net/CONTAINER/PREFIX")
        container, _, rest = parts.path.removeprefix("/").partition("/")
        return BucketURL("az", _container(container, shown), _prefix(rest, shown), m.group(1))
    if scheme == "http":
        host = parts.hostname or ""
        if not _is_loopback(host) or parts.port is None:
            raise BucketURLError(
                f"'{shown}': plain http is only for a storage emulator on this machine "
                "(http://127.0.0.1:PORT/ACCOUNT/CONTAINER/PREFIX); use "
                "https://ACCOUNT.blob.core.windows.net/CONTAINER/PREFIX for Azure Blob")
        account, _, rest = parts.path.removeprefix("/").partition("/")
        container, _, rest = rest.partition("/")
        if not _AZ_ACCOUNT.match(account):
            raise BucketURLError(f"'{account[:80]}' is not a valid storage account name (3-24 "
                                 "lowercase letters and digits), e.g. devstoreaccount1")
        return BucketURL("az", _container(container, shown), _prefix(rest, shown), account,
                         f"http://{parts.netloc}")
    if scheme == "az":
        raise BucketURLError(f"'{shown}': write Azure Blob URLs as "
                             "https://ACCOUNT.blob.core.windows.net/CONTAINER/PREFIX")
    raise BucketURLError(f"'{shown}' is not a bucket URL: use s3://BUCKET/PREFIX, "
                         "gs://BUCKET/PREFIX or https://ACCOUNT.blob.core.windows.net/CONTAINER/PREFIX")


def _shown(raw: str) -> str:
    """``raw`` as an error may show it: without what sits before an '@' in the host part (a
    key and secret) nor anything after a '?' or '#' (a signature, a SAS token), at most 80
    characters."""
    scheme, sep, rest = raw.partition("://")
    if sep:
        host, slash, tail = rest.partition("/")
        if "@" in host:
            host = "***@" + host.rpartition("@")[2]
        rest = host + slash + tail
    text = scheme + sep + rest
    cut = min((i for i in (text.find("?"), text.find("#")) if i >= 0), default=-1)
    if cut >= 0:
        text = text[:cut] + text[cut] + "***"
    return text if len(text) <= 80 else text[:77] + "..."


def s3_name_problem(name: str) -> str:
    """What breaks AWS's naming rules for general purpose buckets in ``name`` ("" if nothing)."""
    if not _S3_BUCKET.match(name):
        return ("3-63 lowercase letters, digits, '-' and '.', starting and ending with a "
                "letter or digit")
    if ".." in name:
        return "two dots in a row"
    if _looks_like_ip(name):
        return "it is written as an IP address"
    for p in S3_RESERVED_PREFIXES:
        if name.startswith(p):
            return f"S3 reserves names starting '{p}'"
    for sfx in S3_RESERVED_SUFFIXES:
        if name.endswith(sfx):
            return f"S3 reserves names ending '{sfx}'"
    return ""


def gs_name_problem(name: str) -> str:
    """What breaks Google Cloud Storage's bucket naming rules in ``name`` ("" if nothing)."""
    if not _GS_BUCKET.match(name) or len(name) > 222:
        return ("3-63 lowercase letters, digits, '-', '_' and '.' (up to 222 with dots, each "
                "dot-separated part at most 63), starting and ending with a letter or digit")
    if "." not in name and len(name) > 63:
        return f"it is {len(name)} characters long; a name without dots has at most 63"
    parts = name.split(".")
    if "" in parts:
        return "two dots in a row"
    if any(len(p) > 63 for p in parts):
        return "a dot-separated part is longer than 63 characters"
    if _looks_like_ip(name):
        return "it is written as an IP address"
    if name.startswith("goog"):
        return "GCS reserves names starting 'goog'"
    if "google" in name.translate(_GS_LOOKALIKE):
        return "GCS refuses names containing 'google' or a look-alike such as 'g00gle'"
    return ""


def _container(name: str, raw: str) -> str:
    if not _AZ_CONTAINER.match(name):
        raise BucketURLError(f"'{name[:80]}' in '{raw}' is not a valid Azure container name: "
                             "3-63 lowercase letters, digits and single '-', e.g. checkpoints")
    return name


def _prefix(path: str, raw: str) -> str:
    """The key prefix from a URL's path: one leading '/' (the one after the bucket) and one
    trailing '/' may be there; any other empty segment ('//') is refused, never dropped."""
    path = path.removeprefix("/")
    if not path:
        return ""
    path = path.removesuffix("/")
    if not path:
        raise BucketURLError(f"'{raw}' has an empty path segment ('//'); remove it")
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PREFIX:
        raise BucketURLError(f"the prefix of '{raw}' is longer than {MAX_PREFIX} bytes")
    segs = path.split("/")
    for s in segs:
        if s == "":
            raise BucketURLError(f"'{raw}' has an empty path segment ('//'); remove it")
        _check_segment(s, raw)
    return "/".join(segs)


def _check_segment(seg: str, raw: str) -> None:
    if seg in (".", ".."):
        raise BucketURLError(f"'{raw}' has a '{seg}' segment; write the prefix without "
                             "'.' or '..' (e.g. s3://my-bucket/run-1)")
    if _SEGMENT_BAD.search(seg) or seg != seg.strip():
        raise BucketURLError(f"'{raw}' has a segment with control characters, '\\' or "
                             "surrounding spaces")


def _looks_like_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
