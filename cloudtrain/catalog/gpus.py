"""GPU models the catalog knows: canonical names, the aliases users type, and the facts the
loader's sanity rules check (per-GPU memory range, GPUs per node).

Canonical names are the catalog's own (``A100`` is the 40 GB part, ``A100-80GB`` the 80 GB
one, ``H100-MEGA`` GCP's a3-mega H100). Lookups ignore case, spaces, ``-`` and ``_`` and a
leading "NVIDIA"/"AMD", so ``a100_40gb``, ``H100 SXM`` and ``nvidia-l4`` all resolve.
"""

from __future__ import annotations

from dataclasses import dataclass

_DEFAULT_COUNTS = (1.0, 2.0, 4.0, 8.0)


@dataclass(frozen=True)
class GPU:
    name: str                          # canonical
    memory_gib: float                  # nominal per-GPU memory, used where a source has none
    memory_range: tuple[float, float]  # plausible per-GPU memory (a full GPU), GiB
    counts: tuple[float, ...] = _DEFAULT_COUNTS   # GPUs per node a cloud sells
    aliases: tuple[str, ...] = ()
    kind: str = "gpu"                  # gpu | accelerator (Trainium)


GPUS: tuple[GPU, ...] = (
    GPU("A100", 40, (36, 42), (1, 2, 4, 8, 16), ("A100-40GB", "A100-40G", "A100-SXM4-40GB")),
    GPU("A100-80GB", 80, (76, 82), aliases=("A100-80G", "A100-80", "A100-SXM4-80GB")),
    GPU("A10", 24, (21, 24.5), aliases=("A10-24GB",)),
    GPU("A10G", 22.35, (21, 24.5), aliases=("A10G-24GB",)),
    GPU("B200", 180, (170, 192), aliases=("B200-180GB", "B200-192GB")),
    GPU("H100", 80, (76, 96), aliases=("H100-SXM", "H100-SXM5", "H100-80GB", "H100-NVL")),
    GPU("H100-MEGA", 80, (76, 82), (8,), aliases=("H100-MEGA-80GB", "A3-MEGA")),
    GPU("H200", 141, (135, 144), aliases=("H200-141GB", "H200-SXM")),
    GPU("K80", 12, (11, 12.5), (1, 2, 4)),
    GPU("L4", 24, (21, 24.5), (0.125, 0.25, 0.5, 1, 2, 4, 8)),
    GPU("L40S", 48, (42, 48.5), aliases=("L40S-48GB",)),
    GPU("M60", 8, (7.5, 8.5), (1, 2, 4)),
    GPU("P100", 16, (12, 16.5), (1, 2, 4)),
    GPU("P4", 8, (7.5, 8.5), (1, 2, 4)),
    GPU("Radeon MI25", 16, (15.5, 16.5), (1,), aliases=("MI25", "Instinct-MI25")),
    GPU("Radeon Pro V520", 8, (7.5, 8.5), (1, 2, 4), aliases=("V520",)),
    GPU("T4", 16, (15, 16.5), aliases=("T4-16GB",)),
    GPU("T4g", 16, (15, 16.5), (1, 2)),
    GPU("Trainium", 32, (30, 33), (1, 16), ("Trainium1", "trn1"), kind="accelerator"),
    GPU("V100", 16, (15, 16.5), aliases=("V100-16GB", "V100-SXM2", "V100-SXM2-16GB")),
    GPU("V100-32GB", 32, (31, 33), aliases=("V100-32G", "V100-32", "V100-SXM2-32GB")),
)


def _norm(name: str) -> str:
    s = name.strip().upper()
    for prefix in ("NVIDIA", "AMD"):
        if s.startswith(prefix) and len(s) > len(prefix):
            s = s[len(prefix):]
    return "".join(ch for ch in s if ch not in " -_")


_BY_NAME = {g.name: g for g in GPUS}
_LOOKUP: dict[str, str] = {}
for _g in GPUS:
    for _n in (_g.name, *_g.aliases):
        _LOOKUP[_norm(_n)] = _g.name


_SEEN: dict[str, str | None] = {}


def canonical_gpu(name: str) -> str | None:
    """The catalog's name for ``name`` (any case or alias), or None if it is not known."""
    if not name:
        return None
    try:
        return _SEEN[name]
    except KeyError:
        pass
    canon = _LOOKUP.get(_norm(name))
    if len(_SEEN) < 4096:
        _SEEN[name] = canon
    return canon


def gpu_info(name: str) -> GPU | None:
    canon = canonical_gpu(name)
    return _BY_NAME[canon] if canon else None


def known_gpus() -> list[str]:
    return [g.name for g in GPUS]


def suggest_gpu(name: str, extra: list[str] | tuple[str, ...] = ()) -> str | None:
    """The closest known name (canonical) to an unknown ``name``, or None. Canonical names
    (and ``extra``, e.g. the models a catalog holds) are tried before aliases."""
    from difflib import get_close_matches

    key = _norm(name)
    if not key:
        return None
    names = {_norm(g.name): g.name for g in GPUS}
    for e in extra:
        names.setdefault(_norm(e), canonical_gpu(e) or e)
    for pool in (names, _LOOKUP):
        close = get_close_matches(key, list(pool), n=1, cutoff=0.6)
        if close:
            return pool[close[0]]
    return None
