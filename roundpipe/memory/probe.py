"""What the machine has free: the host RAM this process may still allocate (``MemAvailable``, or
a cgroup's limit minus its usage if lower). Any thread."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["host_memory_available"]


_PROC = Path("/proc")
_CGROUP = Path("/sys/fs/cgroup")
# A cgroup v1 "no limit" reads as a page-rounded 2**63 - 1; anything this large is no limit.
_NO_LIMIT = 1 << 60


def host_memory_available() -> int | None:
    """Bytes this process may still allocate on the host: the kernel's ``MemAvailable``
    (``/proc/meminfo``), or, if lower, what the memory cgroup this process runs in leaves (its
    limit, or an ancestor's, minus its usage without the reclaimable page cache; cgroup v2 or
    v1). Without ``/proc/meminfo``, the free physical pages (``os.sysconf``); None when
    nothing can be read. Any thread; reads a few small files."""
    candidates = []
    meminfo = _read(_PROC / "meminfo")
    if meminfo is not None:
        for line in meminfo.splitlines():
            if line.startswith("MemAvailable:"):
                candidates.append(int(line.split()[1]) * 1024)
    if not candidates:
        try:
            candidates.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            pass
    cgroup = _cgroup_available()
    if cgroup is not None:
        candidates.append(cgroup)
    return min(candidates) if candidates else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _number(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, key: str) -> int:
    text = _read(path) or ""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _cgroup_available() -> int | None:
    """What the tightest memory cgroup limit on this process's path leaves, or None."""
    text = _read(_PROC / "self" / "cgroup")
    if text is None:
        return None
    best: int | None = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.strip().lstrip("/")
        if controllers == "":  # v2 (the unified hierarchy)
            roots = [_CGROUP, _CGROUP / "unified"]
            files = ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1
            roots = [_CGROUP / "memory"]
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        for root in roots:
            level = root / rel if rel else root
            while True:
                left = _left_in(level, *files)
                if left is not None:
                    best = left if best is None else min(best, left)
                if level == root or root not in level.parents:
                    break
                level = level.parent
    return best


def _left_in(level: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    limit = _number(level / limit_file)
    usage = _number(level / usage_file)
    if limit is None or usage is None or limit >= _NO_LIMIT:
        return None
    # The page cache the kernel reclaims before it kills anything does not count as used.
    used = max(usage - _stat(level / "memory.stat", inactive_key), 0)
    return max(limit - used, 0)
