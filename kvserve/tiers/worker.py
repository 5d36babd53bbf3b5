"""BackgroundQueue: a daemon thread that works through queued items in batches, so that the engine
thread hands work off (tier writes, cold-area encoding) without ever waiting for it.

`put` never blocks: an item that would take the queued bytes past `max_pending_bytes` is dropped and
counted (a tier write or a demotion lost costs a recomputation later, never a wrong answer). A
handler that raises loses its batch, is logged, and the thread goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger("kvserve.tiers")

T = TypeVar("T")


class BackgroundQueue(Generic[T]):
    def __init__(self, name: str, handle: Callable[[list[T]], None], max_pending_bytes: int, batch: int = 1):
        self.name, self.handle = name, handle
        self.max_pending_bytes, self.batch = max_pending_bytes, batch
        self.num_dropped = 0
        self._items: deque[tuple[T, int]] = deque()
        self._pending_bytes = 0  # queued and being handled
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, item: T, nbytes: int) -> bool:
        """Queue `item` (of `nbytes`); False when it was dropped: over the bound, or closed."""
        with self._cond:
            if self._closed or self._pending_bytes + nbytes > self.max_pending_bytes:
                self.num_dropped += 1
                return False
            self._pending_bytes += nbytes
            self._items.append((item, nbytes))
            self._cond.notify_all()
            return True

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything queued so far was handled; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending_bytes or self._items:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Handle what is queued (up to `timeout_s`), then stop the thread."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items:
                    return
                batch = [self._items.popleft() for _ in range(min(self.batch, len(self._items)))]
            try:
                self.handle([item for item, _ in batch])
            except Exception:
                log.exception("%s: handling %d items failed; they are lost", self.name, len(batch))
            with self._cond:
                self._pending_bytes -= sum(nbytes for _, nbytes in batch)
                self._cond.notify_all()
