"""The prefix cache interface, and the cache that caches nothing (`disable_radix_cache`).

The scheduler and the KV manager talk to a prefix cache through this interface only;
`RadixCache` (radix_cache.py) is the real one. `NoPrefixCache` keeps the same contract with
nothing cached: matches are empty, inserting frees what the tree would have taken, and
locks have nothing to protect. Ownership rules are those of radix_cache.py.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from sgl.backend.radix_cache import MatchResult, TreeNode

_EMPTY = torch.empty(0, dtype=torch.int64)


class PrefixCache(Protocol):
    caches: bool  # False: matching is pointless (the scheduler's lpm policy skips it)

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult: ...
    def cache_unfinished(self, tokens: Sequence[int], slots: torch.Tensor,
                         old_last_node: Any) -> tuple[torch.Tensor, Any]: ...
    def cache_finished(self, tokens: Sequence[int], slots: torch.Tensor, last_node: Any) -> None: ...
    def inc_lock_ref(self, node: Any) -> None: ...
    def dec_lock_ref(self, node: Any) -> None: ...
    def evict(self, num_tokens: int) -> int: ...
    def evictable_size(self) -> int: ...
    def total_size(self) -> int: ...
    def cached_slots(self) -> torch.Tensor: ...
    def reset(self) -> None: ...
    def check_integrity(self) -> None: ...


class NoPrefixCache:
    """Caches nothing: every request computes its whole prompt."""

    caches = False

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator
        self.root = TreeNode((), _EMPTY, None, 0)

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        return MatchResult(_EMPTY, self.root)

    def insert(self, tokens: Sequence[int], slots: torch.Tensor) -> int:
        self.cache_finished(tokens, slots, self.root)  # "taken" and dropped
        return 0

    def cache_unfinished(self, tokens: Sequence[int], slots: torch.Tensor,
                         old_last_node: Any) -> tuple[torch.Tensor, Any]:
        return _EMPTY, old_last_node  # the request keeps owning every slot

    def cache_finished(self, tokens: Sequence[int], slots: torch.Tensor, last_node: Any) -> None:
        if slots.numel():
            self.allocator.free(slots)

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def cached_slots(self) -> torch.Tensor:
        return _EMPTY

    def reset(self) -> None:
        pass

    def check_integrity(self) -> None:
        pass
