#!/usr/bin/env bash
# Build the tests' PyTorch image without any registry (none on the internet is reachable here):
# a Debian minbase root from debootstrap (apt's configured mirror), PyTorch's CPU wheel and
# numpy installed into it with pip --target (from pip's configured indexes), then
# 'docker import'. About 2.5 to 5 minutes on 2 cores; the tests build it once per machine
# (the tag carries this recipe's hash: tests/dockerkit.py).
#   usage: build_torch.sh TAG
set -euo pipefail
tag=$1
mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1)
mirror=${mirror:-http://deb.debian.org/debian}
work=$(mktemp -d "${TMPDIR:-/tmp}/ct-image.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/root
debootstrap --variant=minbase --include=python3,python-is-python3,procps bookworm "$root" "$mirror" \
    >"$work/debootstrap.log" 2>&1 || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }
python3 -m pip install --quiet --no-deps --target "$root/usr/local/lib/python3.11/dist-packages" \
    torch==2.13.0 numpy "typing_extensions>=4.10" filelock sympy mpmath networkx jinja2 \
    MarkupSafe fsspec
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$tag" >/dev/null
echo "$tag"
