"""WarmPins: what pinning a warmed text takes and gives back, on top of the chunk store's counted pins.

A warm with pin=true books room in the store's pin budget when it is accepted (a 400 when pinned
memory would pass --max-pinned-fraction), pins its cached chunks under its owner (the text as sent
plus its cache salt) when it finishes, and gives the booking back whatever happens. Unpinning a text
releases that owner's pins only: chunks other texts still pin stay pinned. A pinning warm's owner and
booking are kept here, by request id, from `reserve` until `release`; each text pinned now is kept
by its owner (`texts`: what the engine's rebuild warms and pins again).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.errors import InvalidRequestError
from kvserve.kvcache.hashing import owner_hash, prompt_chunk_hashes
from kvserve.kvcache.manager import KVCacheManager
from kvserve.scheduler.sequence import Sequence


@dataclass(frozen=True)
class PinnedText:
    """A pinning warm's text as sent (its owner and DELETE /v1/warm name it by these tokens) and what
    its chunks' hashes depend on besides: the cache salt and the weight precision it was computed at."""

    token_ids: list[int]
    cache_salt: str | None
    weight_precision: str | None


@dataclass
class PinBooking:
    """A pinning warm's booking (its request's record keeps it): whom its chunks will be pinned under,
    its text, and the blocks booked in the store's pin budget until it finishes."""

    owner: bytes
    text: PinnedText
    num_blocks: int


class WarmPins:
    def __init__(self, kv: KVCacheManager, chunk_size: int, block_size: int, max_pinned_fraction: float):
        self.kv, self.store = kv, kv.store  # pins change through the manager; the store is read
        self.chunk_size, self.block_size = chunk_size, block_size
        self.max_pinned_fraction = max_pinned_fraction
        self._pinned: dict[bytes, PinnedText] = {}  # owner -> its text, while the store has its pins

    @staticmethod
    def owner(root: bytes, token_ids: list[int]) -> bytes:
        return owner_hash(root, token_ids)

    def _keys(self, seq: Sequence) -> tuple[list[bytes], list[int]]:
        """(the chunk keys a warm of this text leaves in the store, blocks of each)."""
        tokens = seq.request.prompt_token_ids
        hashes = prompt_chunk_hashes(tokens, self.chunk_size, seq.cache.root_hash)
        blocks = [self.store.blocks_per_chunk * self.store.num_groups] * (len(tokens) // self.chunk_size)
        if len(hashes) > len(blocks):  # the tail (kept when content reuse is available)
            blocks.append(-(-(len(tokens) % self.chunk_size) // self.block_size))
        return hashes, blocks

    def _error(self, num_new_blocks: int) -> InvalidRequestError:
        store = self.store
        pinned = store.num_pinned_blocks + store.num_reserved_pin_blocks
        return InvalidRequestError(
            f"pinning this text would pin {pinned + num_new_blocks} of the pool's {store.pool.num_blocks} "
            f"KV blocks, above max_pinned_fraction={self.max_pinned_fraction:g} ({store.max_pinned_blocks} "
            "blocks); unpin warmed text (DELETE /v1/warm), warm it with pin=false, or raise "
            "--max-pinned-fraction",
            param="pin",
        )

    def reserve(self, seq: Sequence, text: PinnedText) -> PinBooking:
        """Book the blocks pinning this warm would add, to pin them under its text's owner when it
        finishes; InvalidRequestError past the cap (nothing is booked then)."""
        hashes, blocks = self._keys(seq)
        new = self.store.unpinned_blocks(hashes, blocks)
        if not self.kv.book_pins(new):
            raise self._error(new)
        return PinBooking(self.owner(seq.cache.root_hash, text.token_ids), text, new)

    def release(self, booking: PinBooking) -> None:
        """Give back the warm's booking (finished, aborted, failed, or pinned): once."""
        if booking.num_blocks:
            self.kv.unbook_pins(booking.num_blocks)
            booking.num_blocks = 0

    def pin(self, seq: Sequence, booking: PinBooking) -> str | None:
        """Pin a finished warm's cached chunks under its owner; the error if that would pass the cap."""
        owner, text = booking.owner, booking.text
        self.release(booking)
        hashes, _ = self._keys(seq)
        chunks = [c for c in map(self.store.get, hashes) if c is not None]
        new = sum(len(c.all_block_ids) for c in chunks if not c.pinned)
        if not self.kv.book_pins(new):  # pins changed while it ran
            return self._error(new).message
        self.kv.unbook_pins(new)
        if self.kv.pin(owner, [c.prefix_hash for c in chunks]):
            self._pinned[owner] = text
        return None

    def texts(self) -> list[PinnedText]:
        """The texts pinned now, in the order they were first pinned."""
        return list(self._pinned.values())

    def reset(self) -> None:
        """Forget every warm and pinned text: the store dropped its chunks, pins and bookings
        (ChunkStore.reset, the engine's rebuild)."""
        self._pinned.clear()

    def check_integrity(self, bookings: list[PinBooking]) -> None:
        """`bookings`: those of the requests in flight (their records')."""
        assert sum(b.num_blocks for b in bookings) == self.store.num_reserved_pin_blocks, (
            "pin reservations do not match the warms"
        )
        assert set(self._pinned) == set(self.store.pin_owners()), "pinned texts do not match the pin owners"

    def unpin(self, root: bytes, token_ids: list[int]) -> int:
        """Release the pins a warm of this text holds; returns how many chunks it pinned (0: none)."""
        owner = self.owner(root, token_ids)
        self._pinned.pop(owner, None)
        return self.kv.unpin(owner)
