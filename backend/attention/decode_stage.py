"""DecodeStage: dense copies of the decoding requests' KV, kept from one step to the next.

The pool is token-granular: a request's KV rows are scattered over the pool, so batched
decode attention must first gather them into a padded [B, kv_heads, L, head_dim] block. Done
afresh every step and every layer, that gather moves as many bytes as the attention itself
reads (on the CPU, a third of a 32-request decode step). The stage keeps that block between
steps: each decoding request owns a row, and a step only copies in the positions whose slot
changed since the row was filled, which in steady decode is the one new token per request.

Validity rests on two facts of the pool: a slot held in a running request's table is never
written again while it is held, and a slot freed and handed out again is written only as a
new token of some step. So a staged position is current when (1) its slot equals the table's
slot at that position and (2) it is not one of the positions this step writes (those are
always copied, after the step has written them). A request missing from a step loses its
row, so a row never outlives the run of consecutive steps it was filled in.

Rows are keyed by the request's row in the req_to_token table and packed densely at
[0, B): a leaving request's row is refilled by a joining one or by the last row (moved).
Attention runs in row order, with q and the output permuted to and from batch order.

Size: rows x capacity positions (each one token's K and V in every layer). A (re)built stage
takes at most `allowed` = min(the engine's budget `max_positions`, the pool's slot count;
`HELD_FACTOR` x the tokens the batch's requests hold, or `MIN_POSITIONS` if more), with
headroom for growth inside that; it is rebuilt smaller once it exceeds twice the current
`allowed` (the batch shrank). A batch of very uneven lengths whose padded block exceeds
`allowed` runs without the stage (gathering) and frees it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sgl.backend.attention.base import compute_dtype

_POSITION_ROUNDING = 256  # capacity grows in these steps
_ROW_ROUNDING = 4  # rows grow in these steps
HELD_FACTOR = 2  # stage positions per token the batch's requests hold, at most
MIN_POSITIONS = 4 * _POSITION_ROUNDING  # ... or this many (small batches)


@dataclass
class StagePlan:
    """What one step does to the stage; built once in prepare, used by every layer."""

    rows: torch.Tensor  # [B] stage row of each batch row
    in_order: bool  # rows == arange(B): no permutation needed
    key_mask: torch.Tensor  # [B, 1, 1, L] bool, in stage-row order: True where the key is real
    max_len: int
    copy_slots: torch.Tensor  # [M] pool slots of the positions to copy in
    copy_index: torch.Tensor  # [M * kv_heads] their rows in a layer's stage viewed as [-1, d]


class DecodeStage:
    def __init__(self, max_positions: int, model_dtype: torch.dtype | None = None) -> None:
        # Budget: rows x capacity never exceeds the pool's slot count (at most doubling the
        # KV memory); a step that would need more runs without the stage.
        self.max_positions = max_positions
        # The stage holds keys in the attention's compute dtype: the pool's, promoted with the
        # model's (a float32 model over a 16-bit pool stages float32: widened once, on copy-in,
        # not on every read). None: the pool's dtype.
        self.model_dtype = model_dtype
        self.k: list[torch.Tensor] = []  # per layer [rows_cap, kv_heads, capacity, head_dim]
        self.v: list[torch.Tensor] = []
        self.slots = torch.empty(0, 0, dtype=torch.int64)  # [rows_cap, capacity]; -1: empty
        self.row_of: dict[int, int] = {}  # req_to_token row -> stage row
        # Layers attended since the last plan: a step that stopped part-way (an exception)
        # left rows marked current that some layers never copied in, so the stage restarts.
        self._layers_done = 0
        self._num_layers = 0

    @property
    def capacity(self) -> int:
        return self.slots.shape[1]

    def reset(self) -> None:
        self.row_of.clear()

    def release(self) -> None:
        """Give the stage's memory back (the next decode step allocates and fills it again)."""
        self.k, self.v = [], []
        self.slots = torch.empty(0, 0, dtype=torch.int64)
        self.row_of.clear()

    def plan(self, pool_rows: list[int], lens: list[int], table: torch.Tensor,
             like: torch.Tensor, num_layers: int) -> StagePlan | None:
        """Place the batch's requests in rows and list the positions to copy in.

        Every request computes one token this step, at its last position. `table`: [B, L]
        the requests' slots (L = max(lens)); `like`: a pool buffer [slots, kvh, d].
        Returns None (and empties the stage) when the batch does not fit the budget.
        """
        if self._layers_done != self._num_layers:
            self.reset()
        self._layers_done, self._num_layers = 0, num_layers
        batch, max_len = len(pool_rows), max(lens)
        if not self._fit(batch, max_len, sum(lens), like, num_layers):
            self.release()
            return None
        rows = self._place(pool_rows)
        rows_t = torch.tensor(rows, dtype=torch.int64)
        lens_t = torch.tensor(lens, dtype=torch.int64)
        positions = torch.arange(max_len)
        real = positions[None, :] < lens_t[:, None]  # [B, L]
        fresh = positions[None, :] < (lens_t - 1)[:, None]  # not written by this step
        staged = self.slots[rows_t, :max_len]  # [B, L]
        current = (staged == table) & fresh
        # A row is current up to its first stale position; everything after it is copied.
        valid_len = current.to(torch.int32).cumprod(dim=1).sum(dim=1)  # [B]
        copy = real & (positions[None, :] >= valid_len[:, None])
        b_idx, pos = copy.nonzero(as_tuple=True)
        kv_heads = like.shape[1]
        heads = torch.arange(kv_heads)
        # element (row, head, pos) of a [rows_cap, kvh, capacity, d] stage, as a row of [-1, d]
        copy_index = ((rows_t[b_idx, None] * kv_heads + heads) * self.capacity + pos[:, None])
        copy_slots = table[b_idx, pos]
        self.slots[rows_t, :max_len] = torch.where(real, table, -1)
        self.slots[rows_t, max_len:] = -1
        key_mask = torch.empty_like(real)
        key_mask[rows_t] = real
        in_order = rows == list(range(batch))
        return StagePlan(rows_t, in_order, key_mask[:, None, None, :], max_len, copy_slots,
                         copy_index.view(-1))

    def attend(self, layer: int, q: torch.Tensor, k_buffer: torch.Tensor,
               v_buffer: torch.Tensor, plan: StagePlan, scale: float) -> torch.Tensor:
        """q [B, kv_heads, G, head_dim] in batch order -> [B, kv_heads, G, head_dim]."""
        k, v = self.k[layer], self.v[layer]  # [rows_cap, kvh, capacity, d]
        self._layers_done += 1
        if plan.copy_slots.numel():
            head_dim = k.shape[-1]
            k_new = k_buffer.index_select(0, plan.copy_slots).view(-1, head_dim).to(k.dtype)
            v_new = v_buffer.index_select(0, plan.copy_slots).view(-1, head_dim).to(v.dtype)
            k.view(-1, head_dim).index_copy_(0, plan.copy_index, k_new)
            v.view(-1, head_dim).index_copy_(0, plan.copy_index, v_new)
        batch, length = q.shape[0], plan.max_len
        q = q.to(k.dtype)  # (the stage's dtype is the compute dtype: a no-op in the engine)
        if plan.in_order:
            q_rows = q
        else:
            q_rows = torch.empty_like(q)
            q_rows[plan.rows] = q
        out = F.scaled_dot_product_attention(q_rows, k[:batch, :, :length], v[:batch, :, :length],
                                             attn_mask=plan.key_mask, scale=scale)
        return out if plan.in_order else out[plan.rows]

    # -- internals -------------------------------------------------------------------------

    @property
    def positions(self) -> int:
        """Token positions the stage holds memory for (rows x capacity)."""
        return self.slots.shape[0] * self.capacity

    def _fit(self, batch: int, max_len: int, held: int, like: torch.Tensor,
             num_layers: int) -> bool:
        """Make room for `batch` rows of `max_len` positions (`held`: their total length)."""
        allowed = min(self.max_positions, max(HELD_FACTOR * held, MIN_POSITIONS))
        fits = batch <= self.slots.shape[0] and max_len <= self.capacity
        if fits and self.positions <= 2 * allowed:  # (shrinks only when far too big: no thrash)
            return True
        # Rebuild with headroom within `allowed` (a rebuilt stage starts empty, so every row
        # is copied in again); allocation is most of the cost: ~0.5 s per GB on 2 cores.
        rows = -(-batch // _ROW_ROUNDING) * _ROW_ROUNDING
        if rows * max_len > allowed:
            rows = batch
        cap = -(-(max_len * 5 // 4) // _POSITION_ROUNDING) * _POSITION_ROUNDING
        cap = min(cap, allowed // rows)
        if cap < max_len:
            return False
        shape = (rows, like.shape[1], cap, like.shape[2])
        self.k, self.v = [], []  # release the old stage before allocating the new one
        # zeros, not empty: padding keys are masked, but NaN garbage would still poison SDPA
        dtype = compute_dtype(self.model_dtype, like.dtype)
        self.k = [torch.zeros(shape, dtype=dtype, device=like.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=like.device) for _ in range(num_layers)]
        self.slots = torch.full((rows, cap), -1, dtype=torch.int64)
        self.row_of.clear()
        return True

    def _place(self, pool_rows: list[int]) -> list[int]:
        """Stage row of each request, keeping rows packed in [0, B): requests that stay keep
        their row (moved down if it lies at or above B), joining ones take the free rows."""
        batch = len(pool_rows)
        self.row_of = {pr: row for pr, row in self.row_of.items() if pr in set(pool_rows)}
        taken = set(self.row_of.values())
        holes = iter([row for row in range(batch) if row not in taken])
        for pr, src in list(self.row_of.items()):
            if src >= batch:
                self._move(src, dst := next(holes))
                self.row_of[pr] = dst
        for pr in pool_rows:
            if pr not in self.row_of:
                self.row_of[pr] = dst = next(holes)
                self.slots[dst] = -1
        return [self.row_of[pr] for pr in pool_rows]

    def _move(self, src: int, dst: int) -> None:
        for k, v in zip(self.k, self.v):
            k[dst] = k[src]
            v[dst] = v[src]
        self.slots[dst] = self.slots[src]
