"""The attention mask as a static description, and the tile arithmetic on it.

Nothing here builds an N x N array (except :meth:`MaskSpec.dense`, used only
by the reference).  Kernels call :meth:`MaskSpec.visible` on the index
vectors of one tile, and :meth:`MaskSpec.kv_block_range` /
:meth:`MaskSpec.q_block_range` to learn which tiles to visit at all and
which of those need no per-element mask.

Causal alignment (bottom-right, as in FlashAttention >= 2.1): query ``i``
sees key ``j`` when ``j <= i + (kv_len - q_len)``, so the *last* query row
lines up with the *last* key.  With ``q_len=2, kv_len=5`` (``x`` = visible)::

          keys 0 1 2 3 4
    query 0    x x x x .
    query 1    x x x x x

and with ``q_len=5, kv_len=2`` the first three query rows see nothing::

          keys 0 1
    query 0    . .
    query 1    . .
    query 2    . .
    query 3    x .
    query 4    x x

Rows that see no key produce output 0 and log-sum-exp ``-inf`` (the log of
an empty sum), and zero gradients.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax


def _cdiv(a, b: int):
  """Ceiling division of a non-negative traced or static integer."""
  return lax.div(a + (b - 1), b) if not isinstance(a, int) else -(-a // b)


def _select(cond, a, b):
  """``where`` on int32 scalars that never folds into a bool->int convert.

  ``jnp.where(c, 1, 0)`` becomes ``c.astype(int32)``, which the Pallas
  Triton lowering of jax 0.11.2 turns into an i1 loop bound; selecting
  between two int32 arrays lowers cleanly.
  """
  a = jnp.asarray(a, jnp.int32)
  b = jnp.asarray(b, jnp.int32)
  return lax.select(cond, jnp.broadcast_to(a, cond.shape),
                    jnp.broadcast_to(b, cond.shape))


def _floordiv(a, b: int):
  """Floor division of a non-negative traced or static integer."""
  return lax.div(a, b) if not isinstance(a, int) else a // b


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """Which (query, key) pairs may interact; hashable, so it can be static.

  Attributes:
    q_len: number of valid query positions.
    kv_len: number of valid key positions.
    causal: apply the causal mask.
    causal_offset: query ``i`` sees key ``j`` iff ``j <= i + causal_offset``.
      ``None`` means bottom-right alignment, ``kv_len - q_len``.
  """

  q_len: int
  kv_len: int
  causal: bool = False
  causal_offset: int | None = None

  def __post_init__(self):
    if self.q_len < 1 or self.kv_len < 1:
      raise ValueError(
          f"sequence lengths must be >= 1, got q_len={self.q_len},"
          f" kv_len={self.kv_len}")
    if self.causal_offset is None:
      object.__setattr__(self, "causal_offset", self.kv_len - self.q_len)

  # -- elementwise ----------------------------------------------------------
  def visible(self, q_idx, k_idx):
    """Boolean visibility for broadcastable query and key index arrays.

    Padding positions (``q_idx >= q_len`` or ``k_idx >= kv_len``) are never
    visible, so kernels can pad sequences to whole tiles.
    """
    ok = (q_idx < self.q_len) & (k_idx < self.kv_len)
    if self.causal:
      ok = ok & (k_idx <= q_idx + self.causal_offset)
    return ok

  def dense(self):
    """The ``[q_len, kv_len]`` boolean mask (reference and tests only)."""
    q_idx = jnp.arange(self.q_len)[:, None]
    k_idx = jnp.arange(self.kv_len)[None, :]
    return self.visible(q_idx, k_idx)

  # -- tiles ----------------------------------------------------------------
  def kv_block_range(self, q_start, block_q: int, block_k: int):
    """Key tiles for the query tile ``[q_start, q_start + block_q)``.

    Returns ``(lo, full_lo, full_hi, hi)``: the tile loop visits key tiles
    ``[lo, hi)``; tiles in ``[full_lo, full_hi)`` are visible to every
    (query, key) pair of the tile and need no per-element mask.  Key tiles
    past ``hi`` are skipped entirely (for causal: above the diagonal).
    """
    off = self.causal_offset
    n_kv_full = self.kv_len // block_k  # tiles with no key padding
    if self.causal:
      last_q = jnp.minimum(q_start + block_q, self.q_len) - 1
      hi = _cdiv(jnp.clip(last_q + off + 1, 0, self.kv_len), block_k)
      # Key tile t is below the diagonal for every row when its last key
      # (t+1)*block_k - 1 <= q_start + off.
      full_hi = _floordiv(jnp.maximum(q_start + off + 1, 0), block_k)
      full_hi = jnp.minimum(jnp.minimum(full_hi, n_kv_full), hi)
      # Query padding rows are masked in the partial tiles, so a query
      # tile that runs past q_len has no fully visible tiles at all.
      full_hi = _select(q_start + block_q <= self.q_len, full_hi, 0)
    else:
      hi = jnp.full_like(q_start, _cdiv(self.kv_len, block_k))
      full_hi = _select(q_start + block_q <= self.q_len, n_kv_full, 0)
    lo = jnp.zeros_like(hi)
    full_lo = lo
    return lo, full_lo, full_hi, hi

  def q_block_range(self, k_start, block_k: int, block_q: int):
    """Query tiles for the key tile ``[k_start, k_start + block_k)``.

    Same contract as :meth:`kv_block_range`, transposed: used by the dK/dV
    backward kernel, which holds a key tile and streams query tiles.
    """
    off = self.causal_offset
    n_q_tiles = _cdiv(self.q_len, block_q)
    n_q_full = self.q_len // block_q
    hi = jnp.full_like(k_start, n_q_tiles)
    if self.causal:
      # Row i sees key k_start when i >= k_start - off.
      lo = _floordiv(jnp.clip(k_start - off, 0, self.q_len), block_q)
      # Every row of tile t sees the whole key tile when
      # t*block_q >= k_start + block_k - 1 - off.
      full_lo = _cdiv(jnp.maximum(k_start + block_k - 1 - off, 0), block_q)
    else:
      lo = jnp.zeros_like(k_start)
      full_lo = lo
    full_lo = jnp.clip(full_lo, lo, hi)
    full_hi = jnp.clip(jnp.full_like(k_start, n_q_full), full_lo, hi)
    # A key tile that runs past kv_len has padding columns: mask it all.
    has_pad = k_start + block_k > self.kv_len
    full_lo = _select(has_pad, hi, full_lo)
    full_hi = _select(has_pad, hi, full_hi)
    return lo, full_lo, full_hi, hi
