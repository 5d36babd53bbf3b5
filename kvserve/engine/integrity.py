"""The engine's books checked as one: every owner's own check and every table kept by request id,
collected into one IntegrityError that names each owner or table that disagrees.

`Engine.check_integrity` runs it after every step in tests (check_integrity_each_step) and after a
step that raised, to tell a failure that left the books whole (the engine carries on) from one that
did not (the engine rebuilds its state: Engine.recover). Cheap: set operations over request ids and
the owners' own checks, nothing per token.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.engine.pins import WarmPins
    from kvserve.engine.requests import RequestRecord
    from kvserve.reuse import ContentReuse
    from kvserve.scheduler.scheduler import Scheduler
    from kvserve.tiers.engine_side import EngineTiers

SHOWN_IDS = 3  # request ids named per leaking table


class IntegrityError(AssertionError):
    """The owners' books disagree; `problems` names each owner or table and what is wrong with it."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


class Books:
    """Collects what disagrees, owner by owner, then raises one IntegrityError (`close`)."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def check(self, owner: str, check: Callable[[], None]) -> None:
        """Run an owner's own check (its asserts); a failure is recorded under the owner's name."""
        try:
            check()
        except Exception as e:  # an assert, or a lookup the broken books made fail
            self.problems.append(f"{owner}: {_describe(e)}")

    def within(self, table: str, request_ids: Iterable[str], live: set[str]) -> None:
        """A table kept by request id holds only requests in `live`."""
        leaked = set(request_ids) - live
        if leaked:
            self.problems.append(f"{table} kept for requests that are gone ({_names(leaked)})")

    def same(self, table: str, request_ids: Iterable[str], live: set[str]) -> None:
        """A table kept by request id holds exactly the requests in `live`."""
        ids = set(request_ids)
        self.within(table, ids, live)
        missing = live - ids
        if missing:
            self.problems.append(f"{table} lacks requests in flight ({_names(missing)})")

    def close(self) -> None:
        if self.problems:
            raise IntegrityError(self.problems)


def _names(request_ids: set[str]) -> str:
    shown = ", ".join(sorted(request_ids)[:SHOWN_IDS])
    more = len(request_ids) - SHOWN_IDS
    return f"{shown} and {more} more" if more > 0 else shown


def _describe(e: Exception) -> str:
    """An assert's message, else where it failed; another exception's type and message."""
    if not isinstance(e, AssertionError):
        return f"{type(e).__name__}: {e}"
    if str(e):
        return str(e)
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return f"assertion failed at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"


def check_books(
    scheduler: Scheduler,
    pins: WarmPins,
    reuse: ContentReuse,
    tiers: EngineTiers | None,
    records: dict[str, RequestRecord],
    background: dict[str, RequestRecord],
) -> None:
    """The engine's owners agree (`Engine.check_integrity`): blocks and chunks, pin bookings and pinned
    texts, each request's record (`records`: the requests, `background`: the audits' recomputes), and
    every table a part below the engine keeps by request id holds only requests in flight. Raises one
    IntegrityError naming each owner or table that disagrees."""
    books = Books()
    books.check("scheduler and KV cache", scheduler.check_integrity)
    bookings = [r.pin for r in records.values() if r.pin is not None]
    books.check("warm pins", lambda: pins.check_integrity(bookings))
    served, audits = set(records), set(background)
    books.check("request records", lambda: _check_records(records, background))
    s = scheduler
    queued = [*s.running, *s.waiting, *s.background]
    books.same("scheduler's sequences", (seq.request_id for seq in queued), served | audits)
    tables = reuse.request_ids()
    books.within("content pieces", tables["content pieces"], served | audits)
    books.within("repairs", tables["repairs"], {seq.request_id for seq in s.running})
    books.within("audit traces", tables["audit traces"], served)
    books.same("audit jobs", tables["audit jobs"], audits)
    if tiers is not None:
        books.within("tier loads", tiers.request_ids(), {seq.request_id for seq in s.waiting})
    books.close()


def _check_records(records: dict[str, RequestRecord], background: dict[str, RequestRecord]) -> None:
    """Each record is its request's: keyed by its id, a served one with its output, an audit without."""
    for rid, record in records.items():
        assert record.request_id == rid and not record.seq.request.background, f"record {rid} misfiled"
        assert record.stream is not None, f"request {rid} has no output"
    for rid, record in background.items():
        assert record.request_id == rid and record.seq.request.background, f"record {rid} misfiled"
        assert record.stream is None and record.pin is None, f"audit {rid} has a client's parts"
