"""What a link between the store and the device is: its bandwidth and per-transfer latency, the named
profiles the engine can emulate (`LINKS`, with sources in docs/links.md), and how much of a copy moves as
one chunk (`default_chunk_bytes`). The link itself, the worker that moves copies over it, is
evalsuite.engine.link.worker's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

CHUNK_SECONDS = 1e-3  # link time per chunk: the longest a demand load waits behind a prefetch
NATIVE_CHUNK_BYTES = 16 * 2**20  # ~0.6 ms at PCIe 4.0 speed, when the link is not emulated


@dataclass(frozen=True)
class LinkProfile:
    name: str
    bandwidth: float  # bytes per second
    latency: float  # seconds added to every transfer

    def seconds(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth


# Sustained host->device (or flash->DRAM) read figures; see docs/links.md for sources.
LINKS = {
    "pcie3": LinkProfile("pcie3", 12e9, 10e-6),        # PCIe 3.0 x16: 15.75 GB/s raw, ~12 GB/s pinned copies
    "pcie4": LinkProfile("pcie4", 25e9, 10e-6),        # PCIe 4.0 x16: 31.5 GB/s raw, ~25 GB/s pinned copies
    "pcie5": LinkProfile("pcie5", 50e9, 10e-6),        # PCIe 5.0 x16: 63 GB/s raw, ~50 GB/s pinned copies
    "nvlink-c2c": LinkProfile("nvlink-c2c", 450e9, 2e-6),  # GH200 NVLink-C2C: 900 GB/s total, 450 per direction
    "ufs4": LinkProfile("ufs4", 4.2e9, 100e-6),        # UFS 4.0 sequential read, up to 4,200 MB/s
    "ufs3": LinkProfile("ufs3", 2.1e9, 150e-6),        # UFS 3.1 sequential read, up to 2,100 MB/s
    "sdcard": LinkProfile("sdcard", 0.09e9, 1e-3),     # microSD UHS-I: 104 MB/s bus, ~90 MB/s reads
}
_CUSTOM = re.compile(r"^\s*([\d.]+)\s*GB/s\s*(?:\+\s*([\d.]+)\s*us)?\s*$", re.IGNORECASE)


def parse_link(spec) -> LinkProfile | None:
    """None / 'native': real copies only. A profile name, 'B GB/s', 'B GB/s + L us', or a LinkProfile."""
    if spec is None or isinstance(spec, LinkProfile) or spec == "native":
        return None if spec in (None, "native") else spec
    if isinstance(spec, str) and spec in LINKS:
        return LINKS[spec]
    match = _CUSTOM.match(spec) if isinstance(spec, str) else None
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"unknown link {spec!r}: use one of {', '.join(LINKS)}, 'native', "
                         "or a bandwidth such as '8GB/s' or '8GB/s+20us'")
    return LinkProfile(spec.strip(), float(match.group(1)) * 1e9, float(match.group(2) or 0) * 1e-6)


def default_chunk_bytes(link: LinkProfile | None) -> int:
    """About CHUNK_SECONDS of the link's time (at least 64 KiB), or NATIVE_CHUNK_BYTES."""
    return NATIVE_CHUNK_BYTES if link is None else max(64 * 2**10, int(link.bandwidth * CHUNK_SECONDS))
