"""Fixed state slots: one per live request, for layers whose cache does not grow (a
recurrent state, an encoder's cross-attention K/V).

The slot tensors live in the runner (``spec.allocate_caches``: ``[num_slots, *shape]`` per
layer); this module only says which request holds which slot. A slot handed out again
holds the previous request's values: a layer resets its state where a sequence's context
starts at token 0 (``StateMetadata.fresh``), so nothing needs zeroing here.
"""

from __future__ import annotations


class StateSlots:
    """``allocate`` / ``free`` one slot per request; slots are reused lowest id first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a state cache needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() -> slot 0 first
        self._held: dict[str, int] = {}
        self._tokens: dict[str, int] = {}
        """Tokens the request's state will hold once its scheduled tokens are computed."""

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot(self, request_id: str) -> int:
        """The request's slot, -1 when it holds none."""
        return self._held.get(request_id, -1)

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Make sure the request holds a slot for its first ``num_tokens`` tokens; False,
        changing nothing, when none is free."""
        if request_id not in self._held:
            if not self._free:
                return False
            self._held[request_id] = self._free.pop()
        self._tokens[request_id] = max(num_tokens, self._tokens.get(request_id, 0))
        return True

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Rejected drafts rolled back: the request's state holds its first ``num_tokens``
        tokens (the runner copied the state kept there into the slot,
        ``worker/state_rollback.py``)."""
        if request_id in self._tokens:
            self._tokens[request_id] = min(num_tokens, self._tokens[request_id])

    def holders(self) -> list[str]:
        return list(self._held)

    def num_tokens(self, request_id: str) -> int:
        return self._tokens.get(request_id, 0)

    def free(self, request_id: str) -> None:
        """Give the request's slot back (no-op if it holds none)."""
        slot = self._held.pop(request_id, None)
        self._tokens.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
            self._free.sort(reverse=True)

    def check_integrity(self) -> None:
        """Every slot is free xor held by exactly one request."""
        held = list(self._held.values())
        assert len(set(held)) == len(held), "a state slot is held twice"
        assert not set(held) & set(self._free), "a held state slot is also free"
        assert len(held) + len(self._free) == self.num_slots, "a state slot went missing"
