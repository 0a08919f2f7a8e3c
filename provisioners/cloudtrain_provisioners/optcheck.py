"""The checks that the clouds' ``resources.<cloud>`` options (aws, azure, gcp) share: a value
of a given form, a list of such names none of them twice, a Linux login name, a private IPv4
range. Each is a small function that raises ``ValueError`` with the message the user reads
(pydantic shows it as the field's error); the options classes attach them to their fields
with ``Annotated[..., AfterValidator(...)]`` through the builders below, each with its own
words, e.g.::

    regions: Annotated[list[str], names(REGION_RE, "'{}' is not a GCP region name; ...",
                                        twice="a region is listed twice")] = Field(...)

A message is a ``str.format`` template of the bad value (``'{:.40}'``: its first 40 characters).
A value must match a pattern as a whole (``re.fullmatch``), so a trailing newline never passes.
"""

from __future__ import annotations

import ipaddress
import re

from pydantic import AfterValidator

LINUX_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")


def check_form(v: str | None, pattern: re.Pattern[str], refused: str) -> str | None:
    """``v`` when it is None or matches ``pattern``; else ``refused`` of it."""
    if v is not None and not pattern.fullmatch(v):
        raise ValueError(refused.format(v))
    return v


def check_names(v: list[str], pattern: re.Pattern[str], refused: str,
                twice: str | None = None) -> list[str]:
    """``v`` when each name matches ``pattern`` (else ``refused`` of the first that does not)
    and, with ``twice`` (the message), none stands in it twice."""
    for name in v:
        check_form(name, pattern, refused)
    if twice is not None and len(set(v)) != len(v):
        raise ValueError(twice)
    return v


def check_user(v: str, refused: str, forbidden: tuple[str, ...] = ()) -> str:
    """``v`` when it is a Linux user name (lower case, at most 32 characters) and not one of
    ``forbidden``; else ``refused`` of it."""
    if not LINUX_USER.fullmatch(v) or v in forbidden:
        raise ValueError(refused.format(v))
    return v


def check_private_ipv4(v: str, max_prefix: int, malformed: str, refused: str) -> str:
    """``v`` as a network's canonical text when it is a private IPv4 range of /``max_prefix``
    or larger (host bits clear); ``malformed`` of it when it is no address range at all,
    ``refused`` of it when it is one of another kind."""
    try:
        net = ipaddress.ip_network(v, strict=True)
    except ValueError:
        raise ValueError(malformed.format(v)) from None
    if net.version != 4 or not net.is_private or net.prefixlen > max_prefix:
        raise ValueError(refused.format(v))
    return str(net)


# --- the same checks as field annotations ---------------------------------------------------

def form(pattern: re.Pattern[str], refused: str) -> AfterValidator:
    return AfterValidator(lambda v: check_form(v, pattern, refused))


def names(pattern: re.Pattern[str], refused: str, twice: str | None = None) -> AfterValidator:
    return AfterValidator(lambda v: check_names(v, pattern, refused, twice))


def user(refused: str, forbidden: tuple[str, ...] = ()) -> AfterValidator:
    return AfterValidator(lambda v: check_user(v, refused, forbidden))


def private_ipv4(max_prefix: int, malformed: str, refused: str) -> AfterValidator:
    return AfterValidator(lambda v: check_private_ipv4(v, max_prefix, malformed, refused))
