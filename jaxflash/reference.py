"""Pure-JAX attention: the test oracle and the ``"xla"`` backend.

It builds the full ``[batch, heads, q_len, kv_len]`` logits, so it uses
O(N^2) memory; it exists to be obviously right, and to run everywhere.
Gradients come from JAX's autodiff of this function.

Its mask (:func:`mask`) is written here from the definitions, as plain
comparisons of query and key indices; it shares no code with
:mod:`jaxflash.masks`, whose ``MaskSpec`` the kernels mask with, so a test
of a kernel against this reference checks the mask's meaning too (and
tests/test_masks.py holds ``MaskSpec`` against :func:`mask`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxflash.masks import dropout_keep


def mask(
    q_len: int,
    kv_len: int,
    *,
    causal: bool = False,
    offset: int | None = None,
    window: tuple[int | None, int | None] = (None, None),
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
    q_seq_lengths: jax.Array | None = None,
    kv_seq_lengths: jax.Array | None = None,
    xp=jnp,
) -> jax.Array:
  """Which keys each query sees: bool ``[q_len, kv_len]``, or ``[B,
  q_len, kv_len]`` when segment ids or sequence lengths are given.

  Query ``i`` sees key ``j`` when all of these hold:

  * alignment: query ``i`` stands at key position ``i + offset``; the
    default ``offset`` is ``kv_len - q_len`` (bottom-right: the last query
    stands at the last key);
  * ``causal``: ``j <= i + offset``;
  * ``window = (left, right)``: ``i + offset - left <= j <= i + offset +
    right`` (``None``: no bound on that side);
  * segment ids ``(q_ids [B, T], kv_ids [B, S])``: ``q_ids[b, i] ==
    kv_ids[b, j]`` and the id is not negative (padding sees nothing and
    is seen by nothing);
  * lengths ``[B]`` (right padding): ``i < q_seq_lengths[b]`` and ``j <
    kv_seq_lengths[b]``.

  ``xp`` is the array module: ``jax.numpy`` (traceable), or ``numpy`` for
  NumPy inputs on the host (tests over many shapes, nothing to compile).
  """
  for side, w in zip(("left", "right"), window):
    if w is not None and w < 0:
      raise ValueError(f"window {side}={w} must be >= 0 (or None)")
  if offset is None:
    offset = kv_len - q_len
  q_pos = xp.arange(q_len, dtype=xp.int32)[:, None]   # [T, 1]
  k_pos = xp.arange(kv_len, dtype=xp.int32)[None, :]  # [1, S]
  # How far key j lies right of the key position query i stands at.
  ahead = k_pos - q_pos - offset  # [T, S]
  # Window sides past every key bound nothing: clip them so a huge side
  # (2**31 - 1, 10**12) stays an int32 comparison.
  reach = q_len + kv_len + abs(offset)
  left, right = (None if w is None else min(int(w), reach) for w in window)
  keep = xp.ones((q_len, kv_len), bool)
  if causal:
    keep = keep & (ahead <= 0)
  if right is not None:
    keep = keep & (ahead <= right)
  if left is not None:
    keep = keep & (ahead >= -left)
  if segment_ids is not None:
    q_ids = xp.asarray(segment_ids[0])[:, :, None]   # [B, T, 1]
    kv_ids = xp.asarray(segment_ids[1])[:, None, :]  # [B, 1, S]
    keep = keep & (q_ids == kv_ids) & (q_ids >= 0)
  if q_seq_lengths is not None:
    keep = keep & (q_pos < xp.asarray(q_seq_lengths)[:, None, None])
  if kv_seq_lengths is not None:
    keep = keep & (k_pos < xp.asarray(kv_seq_lengths)[:, None, None])
  return keep


def attention(
    q_BxTxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    offset: int | None = None,
    window: tuple[int | None, int | None] = (None, None),
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
    q_seq_lengths: jax.Array | None = None,
    kv_seq_lengths: jax.Array | None = None,
    logits_soft_cap: float | None = None,
    bias: jax.Array | None = None,
    dense_mask: jax.Array | None = None,
    upcast: bool = True,
    precision=lax.Precision.HIGHEST,
    dropout_rate: float = 0.0,
    dropout_seeds: jax.Array | None = None,
    dropout_shared: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Dense attention; returns ``(out [B,T,H,D], lse [B,H,T] float32)``.

  Args:
    q_BxTxHxD, k_BxSxKxD, v_BxSxKxD: queries, keys, values; ``H`` a multiple
      of ``K`` (grouped-query attention: query head ``h`` uses key/value head
      ``h // (H // K)``).
    causal, offset, window: the positional mask (:func:`mask`);
      ``window`` is ``(left, right)``, ``None`` for unbounded.
    softmax_scale: logits multiplier, default ``1 / sqrt(D)``.
    segment_ids: ``(q_segment_ids [B, T], kv_segment_ids [B, S])``; negative
      ids attend nowhere.
    q_seq_lengths, kv_seq_lengths: ``[B]`` valid lengths (right padding).
    logits_soft_cap: ``cap * tanh(logits / cap)`` before the softmax.
    bias, dense_mask: ``[B | 1, H | 1, T | 1, S | 1]`` arrays (each axis
      full or broadcast): ``bias`` is added to the scaled (and capped)
      logits, a key where the boolean ``dense_mask`` is False is masked,
      as ``jax.nn.dot_product_attention``'s ``bias`` and ``mask``.
    upcast: compute in float32, or float64 for float64 inputs (the
      oracle, ``ref32``).  ``False`` runs every
      step in the input dtype, as a low-precision implementation would
      (``ref_lp`` of the numerics rule, docs/numerics.md).
    precision: matmul precision; HIGHEST keeps float32 exact on GPUs too.
    dropout_rate, dropout_seeds, dropout_shared: attention dropout: the
      probabilities ``masks.dropout_keep`` drops are zeroed and the others
      scaled by ``1 / (1 - rate)`` for the ``P V`` product (the keep mask
      from ``dropout_seeds [B, 4]`` int32, each batch row's seed, and the
      index of the first head, query row and key among the whole
      attention's, and the query head, or head 0 for every head with
      ``dropout_shared``); the log-sum-exp is that of the undropped
      logits.

  A query row that sees no key gets output 0 and log-sum-exp ``-inf``.
  The log-sum-exp is float32 (float64 for float64 inputs).
  """
  dtype = q_BxTxHxD.dtype
  B, T, H, D = q_BxTxHxD.shape
  S, K = k_BxSxKxD.shape[1], k_BxSxKxD.shape[2]
  G = H // K
  scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
  # The softmax runs in float32 at least; float64 inputs (the "xla"
  # backend under jax_enable_x64) keep float64 throughout.
  sdtype = jnp.promote_types(jnp.float32, dtype)
  cdtype = sdtype if upcast else dtype
  q = q_BxTxHxD.astype(cdtype).reshape(B, T, K, G, D)
  k = k_BxSxKxD.astype(cdtype)
  v = v_BxSxKxD.astype(cdtype)

  logits = jnp.einsum("btkgd,bskd->bkgts", q, k, precision=precision,
                      preferred_element_type=cdtype)
  logits = logits * jnp.asarray(scale, cdtype)
  if logits_soft_cap is not None:
    cap = jnp.asarray(logits_soft_cap, cdtype)
    logits = cap * jnp.tanh(logits / cap)
  keep = mask(T, S, causal=causal, offset=offset, window=window,
              segment_ids=segment_ids, q_seq_lengths=q_seq_lengths,
              kv_seq_lengths=kv_seq_lengths)
  keep = keep.reshape((-1, 1, 1, T, S) if keep.ndim == 3 else (T, S))
  logits = logits.astype(sdtype)
  if bias is not None:
    logits = logits + _heads_to_groups(bias, K, G).astype(sdtype)
  if dense_mask is not None:
    keep = keep & _heads_to_groups(dense_mask, K, G)
  logits = jnp.where(keep, logits, -jnp.inf)
  # Safe softmax: rows with no visible key keep max 0, so exp gives 0s
  # rather than exp(-inf - -inf) = NaN.
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  m = lax.stop_gradient(m)
  p = jnp.exp(logits - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  lse = jnp.where(l > 0, jnp.log(jnp.where(l > 0, l, 1.0)) + m, -jnp.inf)
  probs = p / jnp.where(l > 0, l, 1.0)
  if dropout_rate:
    heads = (jnp.zeros((K, G), jnp.int32) if dropout_shared
             else jnp.arange(H, dtype=jnp.int32).reshape(K, G))
    keep = jax.vmap(lambda seed: dropout_keep(
        seed[0], heads[:, :, None, None] + (0 if dropout_shared else seed[1]),
        seed[2] + jnp.arange(T, dtype=jnp.int32)[:, None],
        seed[3] + jnp.arange(S, dtype=jnp.int32)[None, :], dropout_rate))(
            jnp.asarray(dropout_seeds, jnp.int32))
    probs = jnp.where(keep, probs * (1.0 / (1.0 - dropout_rate)), 0.0)
  # Values may be narrower than keys (multi-head latent attention).
  out = jnp.einsum("bkgts,bske->btkge", probs.astype(cdtype), v,
                   precision=precision, preferred_element_type=cdtype)
  out = out.reshape(B, T, H, v.shape[-1]).astype(dtype)
  lse = lse[..., 0].reshape(B, H, T)
  return out, lse


def _heads_to_groups(x, K: int, G: int):
  """A ``[b, H | 1, t, s]`` array as the logits' ``[b, K | 1, G | 1, t,
  s]`` (query head ``h = k * G + g``)."""
  b, n, t, s = x.shape
  return x.reshape((b, 1, 1, t, s) if n == 1 else (b, K, G, t, s))


def paged_attention(
    q_BxTxHxD: jax.Array,
    k_pages_NxPxKxD: jax.Array,
    v_pages_NxPxKxD: jax.Array,
    page_indices_BxM: jax.Array,
    kv_lengths_B: jax.Array,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    window_left: int | None = None,
    upcast: bool = True,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Attention over a paged KV cache, densely: ``(out [B,T,H,D], lse
  [B,H,T])``.  ``k_scale``, ``v_scale`` ``[K]`` float32: FP8 pages'
  dequantization scales per key/value head (pages times scale, in float32;
  in ``q``'s dtype when ``upcast`` is False).

  Sequence ``b``'s key ``s`` is row ``s % P`` of page
  ``page_indices[b, s // P]`` (``P`` the page size); its first
  ``kv_lengths[b]`` keys are valid.  Query row ``t`` sits at position
  ``kv_lengths[b] - T + t`` (the new tokens are already in the cache) and
  sees the valid keys at or before it (causal, bottom-right), and with
  ``window_left`` only those at most that far back.  Page-table entries
  past a sequence's length may hold anything: they are clipped to a page
  that exists, and what it holds is masked.
  """
  num_pages, page, K, D = k_pages_NxPxKxD.shape
  B, M = page_indices_BxM.shape
  T = q_BxTxHxD.shape[1]
  idx = jnp.clip(page_indices_BxM.astype(jnp.int32), 0, num_pages - 1)
  gather = lambda pages: jnp.take(pages, idx, axis=0).reshape(
      B, M * page, K, pages.shape[-1])
  k, v = gather(k_pages_NxPxKxD), gather(v_pages_NxPxKxD)
  if k_scale is not None:
    work = jnp.float32 if upcast else q_BxTxHxD.dtype
    k, v = ((x.astype(jnp.float32) * sc[None, None, :, None]).astype(work)
            for x, sc in ((k, k_scale), (v, v_scale)))
  s = jnp.arange(M * page, dtype=jnp.int32)[None, None, :]
  lengths = kv_lengths_B.astype(jnp.int32)[:, None, None]
  pos = lengths - T + jnp.arange(T, dtype=jnp.int32)[None, :, None]
  keep = (s < lengths) & (s <= pos)
  if window_left is not None:
    keep = keep & (s >= pos - window_left)
  return attention(q_BxTxHxD, k, v, softmax_scale=softmax_scale,
                   logits_soft_cap=logits_soft_cap,
                   dense_mask=keep[:, None], upcast=upcast)
