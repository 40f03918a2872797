"""Progress of a long checkpoint read or write: a tqdm bar when tqdm is installed (it is in the
``examples`` and ``test`` extras, not a dependency), or the caller's own callback.

Threads: a listener is called by the thread that reads or writes (the writer thread for a
save); tqdm's bar may be updated from another thread than the one that made it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Listener", "listener", "BAR_MIN_BYTES"]

# Below this a bar is not worth its line.
BAR_MIN_BYTES = 64 << 20

Listener = Callable[[int, int], None]


def listener(progress: bool | Listener, desc: str, total: int) -> Any:
    """What ``progress`` asks for: None (nothing), the caller's callable (given ``(done,
    total)`` bytes), or, for True and ``total`` of at least :data:`BAR_MIN_BYTES` (0: not known
    yet), a tqdm bar as such a callable with a ``close()``."""
    if callable(progress):
        return progress
    if not progress or 0 < total < BAR_MIN_BYTES:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False)

    class _Bar:
        def __call__(self, done: int, total: int) -> None:
            if bar.total != total:
                bar.total = total
            bar.update(done - bar.n)

        def close(self) -> None:
            bar.close()

    return _Bar()
