"""The ring of context parallelism: each device keeps its query block and
passes its key/value block around ``axis_name`` with ``ppermute``, runs
the kernels on every (query block, visiting key block) pair and merges the
partial results exactly through the log-sum-exp (Liu et al., "Ring
Attention with Blockwise Transformers", arXiv 2310.01889):

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

The backward runs the ring again; each visiting block's dK/dV accumulate
along the ring and come home, where the owner adds its own share; dQ
stays local.  Every block and accumulator moves ``n - 1`` times
(:func:`_steps`).  It uses
the final output and LSE, so every partial gradient is exact.

The kernels of a block pair come from the caller (:class:`Ring`'s
``local_forward`` / ``local_backward``): :mod:`jaxflash.ring` (the
``shard_map`` entry point) and :mod:`jaxflash._partition` (a sequence
sharded under ``jit``) both run this loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxflash import masks
from jaxflash.masks import MaskArrays, MaskSpec


def _merge(out_a, lse_a, out_b, lse_b):
  """Exact merge of two partial softmax results (float32 accumulators)."""
  lse = jnp.logaddexp(lse_a, lse_b)
  safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
  w_a = jnp.exp(lse_a - safe)  # [B, H, T]
  w_b = jnp.exp(lse_b - safe)
  tr = lambda w: jnp.swapaxes(w, 1, 2)[..., None]  # -> [B, T, H, 1]
  return out_a * tr(w_a) + out_b * tr(w_b), lse


def _chunks(x, parts: int):
  """Split the sequence axis (1) of a local block into ``parts`` chunks."""
  return jnp.split(x, parts, axis=1) if parts > 1 else [x]


def varying_axes(x) -> frozenset:
  """The manual mesh axes ``x``'s type varies over (empty outside
  shard_map or with check_vma=False)."""
  return jax.typeof(x).mat.varying


class Ring:
  """Static description of one ring attention call."""

  def __init__(self, axis_name, n, causal, zigzag, params_for, varying,
               local_forward=None, local_backward=None,
               bias_grad: bool = False, transfer=None):
    self.axis_name, self.n, self.causal = axis_name, n, causal
    # blocks -> the next device's blocks: ppermute around axis_name (None),
    # or another move (tools/ring_bench.py --proxy: a local copy).
    self.transfer = transfer
    # local_backward also returns the dense bias's gradient.
    self.bias_grad = bias_grad
    self.zigzag = zigzag and causal
    self.parts = 2 if self.zigzag else 1
    self.params_for = params_for  # MaskSpec -> OpParams
    # The kernels of one block pair: (params, q, k, v, MaskArrays) ->
    # (out, lse), and (..., out, lse, dout, dlse) -> (dq, dk, dv).
    self.local_forward = local_forward
    self.local_backward = local_backward
    # shard_map(check_vma=True): the blocks' types say which manual axes
    # they vary over (the ring's, and any other the blocks are split
    # over: batch on "data", heads on "tensor"), and so must every value
    # the loops and branches combine them with (zeros of skipped pairs,
    # initial accumulators).  Empty without check_vma.
    self.varying = frozenset(varying)

  def vary(self, *xs):
    """``xs`` typed as varying over the blocks' axes (under check_vma)."""
    def cast(x):
      missing = self.varying - varying_axes(x)
      return lax.pcast(x, tuple(sorted(missing)), to="varying") if (
          missing) else x
    return tuple(cast(x) for x in xs)

  def chunk_ids(self, dev):
    """Global chunk indices of the chunks device ``dev`` holds."""
    if self.zigzag:
      return [dev, 2 * self.n - 1 - dev]
    return [dev]

  def relation(self, q_chunk, k_chunk):
    """0: skip (later keys), 1: causal diagonal, 2: fully visible."""
    if not self.causal:
      return jnp.int32(2)
    return jnp.where(k_chunk < q_chunk, 2, jnp.where(k_chunk == q_chunk, 1,
                                                     0)).astype(jnp.int32)


# -- a block pair's mask arrays ------------------------------------------------
#
# The mask arrays of a call sharded over the sequence come in three kinds:
# per query row (q segment ids; the dense bias's and mask's rows), per key
# (kv segment ids, which travel or are gathered with K/V), and global over
# the keys (the dense terms' key axis and FlashMask's columns, whole on
# every device).  A block pair (queries from global row ``q_start``, keys
# from ``k_start``) takes its rows, slices the global key axes, moves
# FlashMask's row ranges to its own rows, and gives dropout's hash its
# global positions.


def _rows(x, part: int, parts: int):
  """Part ``part`` of ``parts`` of a dense term's query axis (2), or the
  term itself where that axis broadcasts."""
  if x is None or parts == 1 or x.shape[2] == 1:
    return x
  c = x.shape[2] // parts
  return x[:, :, part * c:(part + 1) * c]


def _keys(x, start, length: int):
  """Keys ``[start, start + length)`` of a global key axis (the last)."""
  if x is None or x.shape[-1] == length:
    return x
  return lax.dynamic_slice_in_dim(x, start, length, axis=x.ndim - 1)


def pair_arrays(terms: MaskArrays, *, part: int, parts: int, q_start,
                k_start, k_len: int, kv_seg) -> MaskArrays:
  """The mask arrays of the block pair of query part ``part`` (of
  ``parts`` in this device's block, at global row ``q_start``) and the
  ``k_len`` keys from global key ``k_start`` (``kv_seg`` their segment
  ids).  FlashMask's columns hide global rows, so the pair's rows are
  ``q_start`` lower; dropout hashes global rows and keys; ALiBi's
  distance takes the pair's offset ``q_start - k_start`` as its shift."""
  fm = terms.flash_mask
  if fm is not None:
    fm = _keys(fm, k_start, k_len) - jnp.int32(q_start)
  seeds = terms.dropout_seeds
  if seeds is not None:
    seeds = seeds.at[:, 2].add(q_start).at[:, 3].add(k_start)
  alibi = terms.alibi_slopes
  if alibi is not None:
    alibi = alibi.at[..., 1].add(
        jnp.asarray(q_start - k_start, jnp.int32).astype(jnp.float32))
  q_seg = terms.q_segment_ids
  return terms._replace(
      q_segment_ids=None if q_seg is None else _chunks(q_seg, parts)[part],
      kv_segment_ids=kv_seg,
      bias=_keys(_rows(terms.bias, part, parts), k_start, k_len),
      dense_mask=_keys(_rows(terms.dense_mask, part, parts), k_start, k_len),
      flash_mask=fm, dropout_seeds=seeds, alibi_slopes=alibi)


def _add_bias_grad(buf, g, part: int, parts: int, k_start):
  """Adds a pair's bias gradient into the block's (float32, rows of
  ``part`` and keys from ``k_start``)."""
  r0 = 0 if buf.shape[2] == 1 else part * (buf.shape[2] // parts)
  at = (0, 0, r0, k_start)
  cur = lax.dynamic_slice(buf, at, g.shape)
  return lax.dynamic_update_slice(buf, cur + g.astype(jnp.float32), at)


def _pair_forward(ring: Ring, rel, q, k, v, arrays: MaskArrays):
  """(out f32, lse) of one (query chunk, key chunk) pair by its relation."""
  t, s = q.shape[1], k.shape[1]

  def run(causal):
    p = ring.params_for(MaskSpec(t, s, causal))
    out, lse = ring.local_forward(p, q, k, v, arrays)
    return out.astype(jnp.float32), lse

  def skip():
    return ring.vary(jnp.zeros(q.shape, jnp.float32),
                     jnp.full((q.shape[0], q.shape[2], t), -jnp.inf,
                              jnp.float32))

  return lax.switch(rel, [skip, lambda: run(True), lambda: run(False)])


def _pair_backward(ring: Ring, rel, q, k, v, arrays: MaskArrays, out, lse,
                   dout, dlse):
  """(dq, dk, dv[, dbias]) in float32 of one pair by its relation."""
  t, s = q.shape[1], k.shape[1]

  def run(causal):
    p = ring.params_for(MaskSpec(t, s, causal))
    grads = ring.local_backward(p, q, k, v, arrays, out, lse, dout, dlse)
    return tuple(g.astype(jnp.float32) for g in grads)

  def skip():
    zeros = [q.shape, k.shape, v.shape]
    if ring.bias_grad:
      zeros.append(arrays.bias.shape)
    return ring.vary(*(jnp.zeros(z, jnp.float32) for z in zeros))

  return lax.switch(rel, [skip, lambda: run(True), lambda: run(False)])


def _rotate(ring: Ring, xs):
  """Sends each block to the next device of the ring."""
  if ring.transfer is not None:
    return ring.transfer(xs)
  perm = [(i, (i + 1) % ring.n) for i in range(ring.n)]
  return jax.tree.map(lambda x: lax.ppermute(x, ring.axis_name, perm), xs)


def _pair_terms(ring: Ring, terms: MaskArrays, a: int, q_id, k_id,
                chunks: tuple[int, int], kv_seg):
  """The mask arrays of query chunk ``q_id`` (part ``a`` of this device's
  block) and key chunk ``k_id``; ``chunks``: their lengths."""
  return pair_arrays(terms, part=a, parts=ring.parts,
                     q_start=q_id * chunks[0], k_start=k_id * chunks[1],
                     k_len=chunks[1], kv_seg=kv_seg)


def _varying_terms(ring: Ring, terms: MaskArrays) -> MaskArrays:
  """``terms`` typed as varying like the blocks (under check_vma, a whole
  key axis sliced at a device-dependent chunk must be)."""
  return MaskArrays(*(None if x is None else ring.vary(x)[0]
                      for x in terms))


def _steps(ring: Ring, visit, carry, blocks, *, first: int = 0,
           send_after=None):
  """Runs ``visit(i, carry, blocks) -> carry`` for steps ``first .. n -
  1`` (``first`` 0 or 1), this device's blocks visiting at step 0 and
  passed along the ring between steps: ``n - 1`` transfers, none after
  the last step.  Each step's transfer is issued before its kernels and
  depends on nothing they compute, so it overlaps them (double-buffered:
  the step's blocks and the next's are both live).  ``send_after(carry)
  -> carry`` passes part of the carry on after each step from 1 (the
  backward's dK/dV accumulators)."""
  if first == 0:
    carry = visit(0, carry, blocks)
  if ring.n == 1:
    return carry
  send = send_after or (lambda c: c)

  def step(i, state):
    carry, blocks = state
    following = _rotate(ring, blocks)
    return send(visit(i, carry, blocks)), following

  carry, blocks = lax.fori_loop(1, ring.n - 1, step,
                                (carry, _rotate(ring, blocks)))
  return send(visit(ring.n - 1, carry, blocks))


def ring_forward(ring: Ring, q, k, v, terms: MaskArrays):
  """``(out, lse)`` of this device's query block; ``terms``: the block's
  mask arrays (:func:`pair_arrays`' kinds; the kv segment ids travel with
  K/V)."""
  terms = _varying_terms(ring, terms)
  dev = lax.axis_index(ring.axis_name)
  q_parts = _chunks(q, ring.parts)
  chunks = (q.shape[1] // ring.parts, k.shape[1] // ring.parts)
  q_ids = ring.chunk_ids(dev)
  B, T, H, _ = q.shape
  outs = list(ring.vary(*(jnp.zeros(x.shape, jnp.float32)
                           for x in q_parts)))
  lses = list(ring.vary(*(jnp.full((B, H, x.shape[1]), -jnp.inf, jnp.float32)
                          for x in q_parts)))

  def visit(i, carry, blocks):
    outs, lses = carry
    k, v, kv_seg = blocks
    src = lax.rem(dev - i + ring.n, ring.n)  # owner of the visiting block
    k_ids = ring.chunk_ids(src)
    k_parts, v_parts = _chunks(k, ring.parts), _chunks(v, ring.parts)
    ks_parts = _chunks(kv_seg, ring.parts) if kv_seg is not None else None
    new_outs, new_lses = [], []
    for a in range(ring.parts):
      o, l_ = outs[a], lses[a]
      for b in range(ring.parts):
        po, pl_ = _pair_forward(
            ring, ring.relation(q_ids[a], k_ids[b]), q_parts[a], k_parts[b],
            v_parts[b], _pair_terms(ring, terms, a, q_ids[a], k_ids[b], chunks,
                                    ks_parts[b] if ks_parts else None))
        o, l_ = _merge(o, l_, po, pl_)
      new_outs.append(o)
      new_lses.append(l_)
    return new_outs, new_lses

  outs, lses = _steps(ring, visit, (outs, lses),
                      (k, v, terms.kv_segment_ids))
  out = jnp.concatenate(outs, axis=1).astype(q.dtype)
  lse = jnp.concatenate(lses, axis=2)
  return out, lse


def ring_backward(ring: Ring, q, k, v, terms: MaskArrays, out, lse, dout,
                  dlse):
  """``(dq, dk, dv)`` of this device's blocks, and the gradient of its
  dense bias rows (float32, over every key) with ``ring.bias_grad``.

  dK/dV of a visiting block accumulate along the ring from the device
  after its owner (step 1) to the device before it (step n - 1), then
  take one more hop home, where the owner adds its own (step 0) share:
  ``n - 1`` transfers of the accumulators, as of K/V."""
  terms = _varying_terms(ring, terms)
  dev = lax.axis_index(ring.axis_name)
  split = lambda x: _chunks(x, ring.parts)
  q_parts, o_parts, do_parts = split(q), split(out), split(dout)
  chunks = (q.shape[1] // ring.parts, k.shape[1] // ring.parts)
  l_parts = jnp.split(lse, ring.parts, axis=2) if ring.parts > 1 else [lse]
  dl_parts = (jnp.split(dlse, ring.parts, axis=2) if ring.parts > 1
              else [dlse])
  q_ids = ring.chunk_ids(dev)
  zeros_kv = lambda: ring.vary(jnp.zeros(k.shape, jnp.float32),
                               jnp.zeros(v.shape, jnp.float32))
  dq = list(ring.vary(*(jnp.zeros(x.shape, jnp.float32) for x in q_parts)))
  db = (ring.vary(jnp.zeros(terms.bias.shape, jnp.float32))[0]
        if ring.bias_grad else None)

  def visit(i, carry, blocks):
    dq, (dk, dv), db = carry
    k, v, kv_seg = blocks
    src = lax.rem(dev - i + ring.n, ring.n)
    k_ids = ring.chunk_ids(src)
    k_parts, v_parts = split(k), split(v)
    ks_parts = split(kv_seg) if kv_seg is not None else None
    dk_parts, dv_parts = split(dk), split(dv)
    dq = list(dq)
    for a in range(ring.parts):
      for b in range(ring.parts):
        grads = _pair_backward(
            ring, ring.relation(q_ids[a], k_ids[b]), q_parts[a], k_parts[b],
            v_parts[b], _pair_terms(ring, terms, a, q_ids[a], k_ids[b], chunks,
                                    ks_parts[b] if ks_parts else None),
            o_parts[a], l_parts[a], do_parts[a], dl_parts[a])
        dq[a] = dq[a] + grads[0]
        dk_parts[b] = dk_parts[b] + grads[1]
        dv_parts[b] = dv_parts[b] + grads[2]
        if ring.bias_grad:
          db = _add_bias_grad(db, grads[3], a, ring.parts,
                              k_ids[b] * chunks[1])
    acc = (jnp.concatenate(dk_parts, axis=1),
           jnp.concatenate(dv_parts, axis=1))
    return dq, acc, db

  # Step 0 (this device's own blocks) gives its own share; the
  # accumulators of the visiting blocks start empty at step 1.
  blocks = (k, v, terms.kv_segment_ids)
  dq, (dk, dv), db = visit(0, (dq, zeros_kv(), db), blocks)
  send = lambda carry: (carry[0], _rotate(ring, carry[1]), carry[2])
  dq, acc, db = _steps(ring, visit, (dq, zeros_kv(), db), blocks, first=1,
                       send_after=send)
  if ring.n > 1:
    dk, dv = dk + acc[0], dv + acc[1]
  grads = (jnp.concatenate(dq, axis=1).astype(q.dtype), dk.astype(k.dtype),
           dv.astype(v.dtype))
  return grads + (db,) if ring.bias_grad else grads


def _differentiable(forward, backward):
  """``forward(plan, q, k, v, terms) -> (out, lse)`` with a
  ``jax.custom_vjp`` whose backward is ``backward(plan, q, k, v, terms,
  out, lse, dout, dlse) -> (dq, dk, dv)``, run from the final output and
  LSE.  Called as ``attend(plan, q, k, v, *terms)``: ``terms`` a
  :class:`MaskArrays` of integer arrays (segment ids, lengths, FlashMask
  columns) or None."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def attend(plan, q, k, v, *aux):
    return forward(plan, q, k, v, MaskArrays(*aux))

  def fwd(plan, q, k, v, *aux):
    out, lse = forward(plan, q, k, v, MaskArrays(*aux))
    return (out, lse), (q, k, v, aux, out, lse)

  def bwd(plan, res, cotangents):
    q, k, v, aux, out, lse = res
    dout, dlse = cotangents
    grads = backward(plan, q, k, v, MaskArrays(*aux), out, lse,
                     dout.astype(q.dtype), dlse.astype(jnp.float32))
    return (*grads, *(None,) * len(aux))

  attend.defvjp(fwd, bwd)
  return attend


ring_attention = _differentiable(ring_forward, ring_backward)
"""``(out, lse)`` of the ring, differentiable."""


# -- all-gather: Llama 3's context parallelism --------------------------------
#
# Each device gathers the whole key/value sequence once (all-gather over the
# sequence's axes) and runs the kernels on its query block against all of
# it, its block's global position given to the mask as a static offset
# (one kernel variant per device, picked by lax.switch); the backward
# gathers again and returns each device its share of dK/dV by a
# reduce-scatter.  One kernel per device over the whole key sequence and
# no per-step merges, at the price of K/V communication that is not
# overlapped: the cheaper choice where K/V are small next to Q (GQA).


class AllGather:
  """Static description of one all-gather context-parallel call:
  ``params_for(spec)`` gives the op's parameters for a block's MaskSpec;
  ``local_forward`` / ``local_backward`` as :class:`Ring`'s.  With
  ``balance`` (causal calls) the query blocks go to zig-zag order
  (:func:`to_zigzag`) and each half runs at its own offset, so every
  device does the same work; K/V are gathered in natural order."""

  def __init__(self, axis_name, n, params_for, mask: MaskSpec,
               local_forward, local_backward, balance: bool = False,
               bias_grad: bool = False):
    self.axis_name, self.n = axis_name, n
    self.bias_grad = bias_grad  # local_backward also returns dbias
    self.params_for, self.mask = params_for, mask
    self.local_forward, self.local_backward = local_forward, local_backward
    self.balance = balance

  def spec(self, start: int, t: int, s: int) -> MaskSpec:
    """The mask of ``t`` queries starting at global row ``start`` over
    all ``s`` keys: the call's alignment moved by ``start`` (global row
    ``r`` sits at key ``r + mask.offset``)."""
    m = self.mask
    return MaskSpec(t, s, causal=m.causal, offset=m.offset + start,
                    window_left=m.window_left, window_right=m.window_right)

  def pieces(self, dev: int, t: int) -> list[tuple[int, int]]:
    """``(global start, length)`` of device ``dev``'s query pieces, in
    the order its (zig-zag or contiguous) block holds them."""
    if not self.balance:
      return [(dev * t, t)]
    c = t // 2
    return [(dev * c, c), ((2 * self.n - 1 - dev) * c, c)]


def _gather(ag: AllGather, *xs):
  return tuple(None if x is None else lax.all_gather(
      x, ag.axis_name, axis=1, tiled=True) for x in xs)


def _by_device(ag: AllGather, fn):
  """``fn(dev)`` for this device's index, a static int in each branch."""
  return lax.switch(lax.axis_index(ag.axis_name),
                    [lambda d=d: fn(d) for d in range(ag.n)])


def _zz(ag: AllGather, x, axis: int = 1):
  return to_zigzag(x, ag.axis_name, ag.n, axis) if ag.balance else x


def _unzz(ag: AllGather, x, axis: int = 1):
  return from_zigzag(x, ag.axis_name, ag.n, axis) if ag.balance else x


def _halves(ag: AllGather, x, axis: int = 1):
  return jnp.split(x, 2, axis=axis) if ag.balance else [x]


def fold_lengths(terms: MaskArrays, axis, q_block: int,
                 kv_block: int) -> MaskArrays:
  """Sequence lengths folded into segment ids for this device's blocks
  (natural order: block ``i`` of the sequence axis ``axis`` holds
  positions ``[i * block, (i + 1) * block)``): a position at or past its
  row's length takes :data:`jaxflash.masks.PAD_SEGMENT_ID`
  (:func:`jaxflash.masks.fold_lengths`, as the kernels fold them on one
  device).  Unchanged without lengths."""
  q_len, kv_len = terms.q_seq_lengths, terms.kv_seq_lengths
  if q_len is None and kv_len is None:
    return terms
  i = lax.axis_index(axis)
  batch = (q_len if q_len is not None else kv_len).shape[0]
  return terms._replace(
      q_segment_ids=masks.fold_lengths(terms.q_segment_ids, q_len, batch,
                                       q_block, i * q_block),
      kv_segment_ids=masks.fold_lengths(terms.kv_segment_ids, kv_len, batch,
                                        kv_block, i * kv_block),
      q_seq_lengths=None, kv_seq_lengths=None)


def zigzag_rows(terms: MaskArrays, zz) -> MaskArrays:
  """``terms`` with their per-query-row arrays taken through ``zz`` (a
  block reorder along an axis): q segment ids (axis 1) and the dense
  bias's and mask's rows (axis 2, where not broadcast)."""
  rows = lambda x: x if x is None or x.shape[2] == 1 else zz(x, 2)
  return terms._replace(
      q_segment_ids=(None if terms.q_segment_ids is None
                     else zz(terms.q_segment_ids, 1)),
      bias=rows(terms.bias), dense_mask=rows(terms.dense_mask))


def _piece(ag: AllGather, terms: MaskArrays, i: int, start: int, t: int,
           kv_seg, s: int) -> MaskArrays:
  """Query piece ``i``'s mask arrays (rows ``[start, start + t)`` against
  all ``s`` keys): :func:`pair_arrays`, and the global query lengths as
  the piece's own.  ALiBi's distances are global through the piece's
  MaskSpec offset (``start``)."""
  a = pair_arrays(terms, part=i, parts=2 if ag.balance else 1,
                  q_start=start, k_start=0, k_len=s, kv_seg=kv_seg)
  if a.q_seq_lengths is not None:
    a = a._replace(q_seq_lengths=jnp.clip(a.q_seq_lengths - start, 0, t))
  return a


def allgather_forward(ag: AllGather, q, k, v, terms: MaskArrays):
  k, v, kv_seg = _gather(ag, k, v, terms.kv_segment_ids)
  qs, terms = _halves(ag, _zz(ag, q)), zigzag_rows(
      terms, functools.partial(_zz, ag))
  s = k.shape[1]

  def run(d):
    outs = [ag.local_forward(ag.params_for(ag.spec(start, t, s)), qs[i], k,
                             v, _piece(ag, terms, i, start, t, kv_seg, s))
            for i, (start, t) in enumerate(ag.pieces(d, q.shape[1]))]
    return (jnp.concatenate([o for o, _ in outs], axis=1),
            jnp.concatenate([lse for _, lse in outs], axis=2))

  out, lse = _by_device(ag, run)
  return _unzz(ag, out), _unzz(ag, lse, 2)


def allgather_backward(ag: AllGather, q, k, v, terms: MaskArrays, out, lse,
                       dout, dlse):
  """``(dq, dk, dv)``, and with ``ag.bias_grad`` the gradient of this
  device's dense bias rows (float32, over every key)."""
  k_all, v_all, kv_seg = _gather(ag, k, v, terms.kv_segment_ids)
  split = lambda x, axis=1: _halves(ag, _zz(ag, x, axis), axis)
  qs, outs, douts = split(q), split(out), split(dout)
  lses, dlses = split(lse, 2), split(dlse, 2)
  terms = zigzag_rows(terms, functools.partial(_zz, ag))
  s = k_all.shape[1]

  def run(d):
    dq, dk, dv, db = [], 0.0, 0.0, []
    for i, (start, t) in enumerate(ag.pieces(d, q.shape[1])):
      grads = ag.local_backward(
          ag.params_for(ag.spec(start, t, s)), qs[i], k_all, v_all,
          _piece(ag, terms, i, start, t, kv_seg, s), outs[i], lses[i],
          douts[i], dlses[i])
      dq.append(grads[0])
      dk = dk + grads[1].astype(jnp.float32)
      dv = dv + grads[2].astype(jnp.float32)
      if ag.bias_grad:
        db.append(grads[3].astype(jnp.float32))
    res = (jnp.concatenate(dq, axis=1), dk, dv)
    if ag.bias_grad:  # the pieces' rows, or their sum where rows broadcast
      res += (sum(db) if terms.bias.shape[2] == 1
              else jnp.concatenate(db, axis=2),)
    return res

  dq, dk, dv, *db = _by_device(ag, run)
  # Every device holds gradients for every key; each keeps the sum of its
  # own block's (in float32, then the inputs' dtype).
  scatter = lambda g, like: lax.psum_scatter(
      g, ag.axis_name, scatter_dimension=1, tiled=True).astype(like.dtype)
  grads = (_unzz(ag, dq), scatter(dk, k), scatter(dv, v))
  if ag.bias_grad:
    grads += (db[0] if terms.bias.shape[2] == 1 else _unzz(ag, db[0], 2),)
  return grads


def choose(mode: str | None, heads: int, kv_heads: int,
           global_positions: bool) -> str:
  """The context-parallel scheme: ``mode`` when given ("ring" or
  "allgather"), else the cost rule.  All-gather moves all of K/V once,
  not overlapped, and runs one kernel per device; the ring moves the same
  bytes in n - 1 steps overlapped with the kernels but runs n kernels and
  merges.  Where K/V are at most a quarter of Q's size (GQA 4:1 or more,
  Llama 3's case) the gather is the smaller cost; a local window, ALiBi
  or queries and keys of different lengths or alignment
  (``global_positions``: what the ring serves less well or not at all)
  also take the gather.  Otherwise the ring."""
  if mode is not None:
    return mode
  if global_positions or heads >= 4 * kv_heads:
    return "allgather"
  return "ring"


# -- causal balance: contiguous blocks <-> zig-zag ------------------------
#
# With the sequence cut in 2n chunks, contiguous blocks put chunks 2d and
# 2d + 1 on device d, and causal attention gives device d about 2d + 1
# chunk pairs of work: the last device does 2n - 1 times the first's.
# Zig-zag blocks (chunks i and 2n - 1 - i on device i) give every device
# the same.  Two ppermutes of half-blocks move one to the other: the even
# chunk of each zig-zag pair travels in one, the odd chunk in the other
# (i and 2n - 1 - i differ in parity), so each token moves once each way.


def balances(causal: bool, n: int, local_len: int) -> bool:
  """Whether a call goes to zig-zag order: causal, several devices, and
  blocks that split into two chunks."""
  return causal and n > 1 and local_len % 2 == 0


def _zigzag_perms(n: int):
  home = lambda c: c if c < n else 2 * n - 1 - c  # zig-zag device of c
  return ([(d, home(2 * d)) for d in range(n)],
          [(d, home(2 * d + 1)) for d in range(n)])


def to_zigzag(x, axis_name, n: int, axis: int = 1):
  """This device's contiguous block (chunks ``2d, 2d + 1``) -> its
  zig-zag block (chunks ``d, 2n - 1 - d``) along ``axis``."""
  if x is None:
    return None
  evens, odds = _zigzag_perms(n)
  a, b = jnp.split(x, 2, axis=axis)
  a, b = lax.ppermute(a, axis_name, evens), lax.ppermute(b, axis_name, odds)
  even = lax.axis_index(axis_name) % 2 == 0  # chunk d is the even one
  return jnp.concatenate([jnp.where(even, a, b), jnp.where(even, b, a)],
                         axis=axis)


def from_zigzag(x, axis_name, n: int, axis: int = 1):
  """The inverse of :func:`to_zigzag`."""
  if x is None:
    return None
  evens, odds = _zigzag_perms(n)
  back = lambda perm: [(t, d) for d, t in perm]
  first, second = jnp.split(x, 2, axis=axis)
  even = lax.axis_index(axis_name) % 2 == 0
  e, o = jnp.where(even, first, second), jnp.where(even, second, first)
  return jnp.concatenate([lax.ppermute(e, axis_name, back(evens)),
                          lax.ppermute(o, axis_name, back(odds))],
                         axis=axis)
