"""``jaxflash.autotune``: the Hopper config measured fastest for one call
signature on this device, cached on disk for later calls of its class.

The tuned defaults (``mosaic_gpu/tuning.json`` and the rules of
``mosaic_gpu.config``) serve every call without measuring anything; this
is for users who want the last percent at the shapes they run.  It times
candidate configs (the default and one-field changes of it: the grid,
the consumers, the key tile, the causal pairing, the dK/dV split) in
interleaved rounds, keeps the fastest and writes it to the cache of
:mod:`jaxflash.mosaic_gpu.autotuned` (keyed by device kind, jax version
and the call's class), which ``flash_attention`` and
``dot_product_attention`` then read for calls of that class that pass no
config.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from jaxflash import _timing, api, checks
from jaxflash.mosaic_gpu import autotuned
from jaxflash.mosaic_gpu import backend as mosaic_backend
from jaxflash.mosaic_gpu.config import (
  MAX_THREE_WG_HEAD_DIM,
  MosaicConfig,
  default_config,
  head_dim_problem,
  kernel_head_dim,
)

log = logging.getLogger(__name__)

MODES = ("fwd", "fwd_bwd")


def candidate_configs(base: MosaicConfig, *, head_dim: int, causal: bool,
                      group_size: int, mode: str) -> list[MosaicConfig]:
  """``base`` and the one-field changes of it worth timing: the plain or
  persistent grid, two or three consumers, key tiles of 64, 128 and 176
  rows, the causal longest-with-shortest pairing and the other causal
  order (longest first or heads fastest); for the backward
  (``mode="fwd_bwd"``) its query tile and, with GQA/MQA, whole groups per
  dK/dV program.  Changes the config refuses (or that do not fit this
  head_dim) are left out."""
  dp = kernel_head_dim(head_dim)
  changes = [dict(persistent=not base.persistent)]
  for wgs in (2, 3):
    if wgs != base.compute_wgs and (wgs < 3 or dp <= MAX_THREE_WG_HEAD_DIM):
      changes.append(dict(compute_wgs=wgs, consumer_registers=None,
                          schedule_barrier=wgs == 2))
  changes += [dict(block_kv=bk) for bk in (64, 128, 176)
              if bk != base.block_kv]
  if causal:
    if not base.persistent_pairs:
      changes.append(dict(persistent=True, persistent_pairs=True))
    # The other order of the causal persistent grid without pairs
    # (longest first or heads fastest).
    changes.append(dict(persistent=True, persistent_pairs=False,
                        causal_lpt=not base.causal_lpt))
  if mode == "fwd_bwd":
    changes += [dict(bwd_block_q=bq) for bq in (64, 128)
                if bq != base.bwd_block_q]
    if group_size > 1 and not base.bwd_paired_dkv:
      changes.append(dict(bwd_head_splits=1))
  out = [base]
  for change in changes:
    try:
      cfg = dataclasses.replace(base, **change)
    except ValueError:  # an option of base that this change excludes
      continue
    if cfg not in out and head_dim_problem(cfg, dp) is None:
      out.append(cfg)
  return out


def autotune(q, k, v, *, causal: bool = False, local_window_size=None,
             softmax_scale: float | None = None,
             logits_soft_cap: float | None = None, mode: str = "fwd_bwd",
             candidates: list[MosaicConfig] | None = None, samples: int = 5,
             min_sample_s: float = 0.01, store: bool = True,
             interpret: bool = False) -> MosaicConfig:
  """Times Hopper configs for this call and returns the fastest.

  Args:
    q, k, v: arrays of the call (``[batch, seq, heads, head_dim]``), or
      of its shape and dtype.
    causal, local_window_size, softmax_scale, logits_soft_cap: as
      :func:`jaxflash.flash_attention`.
    mode: ``"fwd"`` times the forward, ``"fwd_bwd"`` (the default) the
      forward and its VJP, as training runs it.
    candidates: the configs to time (default: :func:`candidate_configs`
      around this device's tuned default).
    samples: timed rounds; each round times every candidate once for
      at least ``min_sample_s`` seconds, in a balanced order (the
      benchmark's ``time_interleaved``); the lowest median wins.
    store: write the winner to the autotune cache
      (:mod:`jaxflash.mosaic_gpu.autotuned`; off where
      ``JAXFLASH_AUTOTUNE_CACHE`` is empty or ``off``), so that later
      calls of the class pass no config and get it.
    interpret: run the kernels in the Mosaic GPU interpreter (a CPU
      check of the mechanism; its times say nothing of the GPU's).

  Returns:
    The fastest config.  Candidates that fail to compile or run (e.g. out
    of shared memory) are skipped; ValueError when none runs.
  """
  if mode not in MODES:
    raise ValueError(f"mode={mode!r} must be one of {MODES}")
  if not isinstance(samples, int) or samples < 1:
    raise ValueError(f"samples={samples!r} must be a positive integer")
  q, k, v = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
  kind = jax.devices()[0].device_kind
  if candidates is None:
    base = default_config(kind, kernel_head_dim(q.shape[3]), causal=causal,
                          kv_len=k.shape[1])
    candidates = candidate_configs(
        base, head_dim=q.shape[3], causal=causal,
        group_size=q.shape[2] // k.shape[2], mode=mode)
  keys = jax.random.split(jax.random.key(0), 4)
  args = [jax.random.normal(key, x.shape, x.dtype)
          for key, x in zip(keys, (q, k, v, q))]
  if mode == "fwd":
    args = args[:3]

  def call(config):
    def attend(q, k, v):
      return api.flash_attention(
          q, k, v, causal=causal, local_window_size=local_window_size,
          softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
          implementation="mosaic_gpu", config=config, interpret=interpret)
    if mode == "fwd":
      return jax.jit(attend)

    def fwd_bwd(q, k, v, do):
      _, vjp = jax.vjp(attend, q, k, v)
      return vjp(do)
    return jax.jit(fwd_bwd)

  # Interleaved rounds in a balanced order, as the benchmark times.
  got = _timing.time_interleaved(
      {i: (call(config), args) for i, config in enumerate(candidates)},
      samples=samples, min_sample_s=min_sample_s)
  medians = {}
  for i, t in got.items():
    if isinstance(t, Exception):  # a candidate that cannot run
      log.info("autotune: candidate %d skipped: %s", i, t)
    else:
      medians[i] = t
  if not medians:
    raise ValueError(f"autotune: none of the {len(candidates)} candidate"
                     " configs ran for this call")
  best = min(medians, key=medians.get)
  for i, t in sorted(medians.items(), key=lambda it: it[1]):
    log.info("autotune: %.4f ms %s", t * 1e3, candidates[i])
  winner = candidates[best]
  if store:
    mask = checks.mask_spec(q.shape[1], k.shape[1], causal=causal,
                            local_window_size=local_window_size)
    path = autotuned.store(kind, mosaic_backend.autotune_key(q, k, mask),
                           winner)
    log.info("autotune: %s stored in %s", winner, path)
  return winner
