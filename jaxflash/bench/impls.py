"""The implementations the benchmark compares, each behind one signature.

``IMPLS[name](shape, mask_kwargs, interpret) -> attend(q, k, v) -> out``;
an implementation that cannot serve a shape raises (NotImplementedError
with the reason), which the benchmark records as a row, never a crash.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp

import jaxflash
from jaxflash import flashmask
from jaxflash._util import round_up
from jaxflash.bench.core import Shape


def _jaxflash(backend: str):
  def make(shape: Shape, mask_kw: dict, interpret: bool) -> Callable:
    def attend(q, k, v):
      return jaxflash.flash_attention(q, k, v, causal=shape.causal,
                                      implementation=backend,
                                      interpret=interpret, **mask_kw)
    return attend
  return make


def _no_dropout(name: str, mask_kw: dict) -> None:
  """Peers' dropout draws other keep masks than jaxflash's hash: no common
  reference to check them against, so they sit those rows out."""
  if "dropout_rate" in mask_kw:
    raise NotImplementedError(
        f"{name}: no attention dropout with jaxflash's keep mask (its own,"
        " if any, drops other probabilities: nothing to check it against)")


def _jax_nn(implementation: str):
  def make(shape: Shape, mask_kw: dict, interpret: bool) -> Callable:
    del interpret
    _no_dropout("jax.nn.dot_product_attention", mask_kw)
    if "segment_ids" in mask_kw:
      raise NotImplementedError(
          "jax.nn.dot_product_attention takes no segment ids (a dense mask"
          " would be N x N)")
    window = mask_kw.get("local_window_size")

    def attend(q, k, v):
      return jax.nn.dot_product_attention(
          q, k, v, bias=mask_kw.get("bias"), mask=mask_kw.get("mask"),
          is_causal=shape.causal, local_window_size=window,
          implementation=implementation)
    return attend
  return make


def _cudnn_fp8(shape: Shape, mask_kw: dict, interpret: bool) -> Callable:
  """cuDNN's FP8 attention (jax's private
  ``fused_attention_stablehlo.dot_product_attention(..., use_fp8=True)``,
  per-tensor scales, here all 1 as the benchmark's FP8 inputs are exact):
  causal or no mask, forward, output in e4m3."""
  del interpret
  if mask_kw:
    raise NotImplementedError(
        f"cuDNN's FP8 attention takes a causal mask or none, not"
        f" {sorted(mask_kw)}")
  if shape.jnp_dtype.itemsize != 1:
    raise NotImplementedError("cudnn-fp8 takes the --dtype fp8 rows")
  from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: PLC0415
  one = jnp.ones((1, 1, 1, 1), jnp.float32)
  params = dict.fromkeys(cudnn.fp8_params_keys, one)
  mask_type = cudnn.MaskType.CAUSAL if shape.causal else cudnn.MaskType.NO_MASK

  def attend(q, k, v):
    out, _, _ = cudnn.dot_product_attention(
        q, k, v, fp8_params=params, scale=shape.head_dim ** -0.5,
        mask_type=mask_type, use_fp8=True)
    return out
  return attend


def _pallas_mha(shape: Shape, mask_kw: dict, interpret: bool) -> Callable:
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import attention as mha_lib
  _no_dropout("JAX's Pallas mha", mask_kw)
  if shape.kv_heads != shape.heads:
    raise NotImplementedError("JAX's Pallas mha has no GQA/MQA")
  if "local_window_size" in mask_kw:
    raise NotImplementedError("JAX's Pallas mha has no local window")
  if "bias" in mask_kw or "mask" in mask_kw:
    raise NotImplementedError("JAX's Pallas mha takes no dense bias or mask")
  seg = mask_kw.get("segment_ids")
  scale = shape.head_dim ** -0.5

  def attend(q, k, v):
    return mha_lib.mha(q, k, v, seg, sm_scale=scale, causal=shape.causal,
                       block_sizes=mha_lib.BlockSizes.get_default(),
                       interpret=interpret)
  return attend


def _tokamax(implementation: str):
  def make(shape: Shape, mask_kw: dict, interpret: bool) -> Callable:
    del interpret
    try:
      import tokamax
    except ImportError as e:
      raise NotImplementedError(f"tokamax is not importable: {e}") from e
    _no_dropout("tokamax", mask_kw)
    if "segment_ids" in mask_kw:
      raise NotImplementedError(
          "tokamax takes segments only as a dense N x N mask")
    window = mask_kw.get("local_window_size")

    def attend(q, k, v):
      return tokamax.dot_product_attention(
          q, k, v, bias=mask_kw.get("bias"), mask=mask_kw.get("mask"),
          is_causal=shape.causal, local_window_size=window,
          implementation=implementation)
    return attend
  return make


IMPLS: dict[str, Callable] = {
    "jaxflash-mosaic_gpu": _jaxflash("mosaic_gpu"),
    "jaxflash-triton": _jaxflash("triton"),
    "jaxflash-xla": _jaxflash("xla"),
    "cudnn": _jax_nn("cudnn"),
    "cudnn-fp8": _cudnn_fp8,
    "xla": _jax_nn("xla"),
    "jax-pallas-mha": _pallas_mha,
    "tokamax-mosaic": _tokamax("mosaic"),
    "tokamax-triton": _tokamax("triton"),
}

def mosaic_variant(overrides: dict, tuned_for: str | None = None
                   ) -> Callable:
  """The Hopper kernel with each shape's tuned default config (the one
  ``implementation=None`` would pick on this device, or on a device of
  kind ``tuned_for``: tuning.json's entry for it) and ``overrides``
  (MosaicConfig fields) replaced, so that configs are compared in the same
  interleaved rounds as the other implementations."""
  def make(shape: Shape, mask_kw: dict, interpret: bool) -> Callable:
    from jaxflash import mosaic_gpu  # noqa: PLC0415
    base = mosaic_gpu.default_config(
        tuned_for or jax.devices()[0].device_kind,
        round_up(shape.head_dim, 64),
        causal=shape.causal,
        kv_len=shape.seq_k)
    config = dataclasses.replace(base, **overrides)

    def attend(q, k, v):
      return jaxflash.flash_attention(q, k, v, causal=shape.causal,
                                      implementation="mosaic_gpu",
                                      config=config, interpret=interpret,
                                      **mask_kw)
    return attend
  return make


def parse_mosaic_variants(text: str, tuned_for: str | None = None
                          ) -> dict[str, Callable]:
  """``"stages3:bwd_stages=3;dqk:bwd_atomic_dq=0"`` ->
  implementations ``jaxflash-mosaic_gpu[stages3]``, ... (ValueError on an
  unnamed variant, an unknown field or a ``tuned_for`` kind that
  tuning.json does not list; ``"default"`` names its untuned entry, the
  one unlisted devices get)."""
  from jaxflash.mosaic_gpu import config  # noqa: PLC0415
  kinds = [*config.tuned_device_kinds(), "default"]
  if tuned_for is not None and tuned_for not in kinds:
    raise ValueError(f"--tuned-for {tuned_for!r}: tuning.json lists"
                     f" {kinds}")
  return {f"jaxflash-mosaic_gpu[{name}]": mosaic_variant(overrides,
                                                         tuned_for)
          for name, overrides in config.parse_variants(text).items()}


# A tiny CPU smoke run exercises these (interpret mode for the kernel).
CPU_IMPLS = ("jaxflash-triton", "jaxflash-xla", "xla")


def flashmask_dense(mask, shape: Shape, rows: int | None = None):
  """A FlashMask's dense boolean form ``[B|1, H|1, T, S]`` (its last
  ``rows`` query rows only, if given)."""
  full = mask.check(shape.batch, shape.heads, shape.seq_q, shape.seq_k)
  dense = full.dense(shape.seq_q)
  return dense if rows is None else dense[:, :, -rows:]


def tiles_skipped(shape: Shape, mask_kw: dict, block: int = 128):
  """The fraction of ``block x block`` (query tile, key tile) pairs, over
  the batch rows and heads, that the shape's mask (with ``causal``) hides
  entirely, or None for no mask (or a bias).  A FlashMask's tiles are
  classified by the kernels' own rule (:func:`jaxflash.flashmask.
  tile_class`, from the columns' extremes); segment ids, windows and
  dense masks are taken exactly from their dense form (segment ids as
  the kernels' per-tile summaries see contiguous documents)."""
  if shape.mask is None or shape.mask == "bias" or shape.mask.startswith(
      "dropout"):
    return None
  t, s = shape.seq_q, shape.seq_k
  nq, nk = -(-t // block), -(-s // block)
  q_lo = jnp.arange(nq, dtype=jnp.int32)[:, None] * block
  q_hi = jnp.minimum(q_lo + block, t)
  k_lo = jnp.arange(nk, dtype=jnp.int32)[None, :] * block
  hidden = jnp.zeros((nq, nk), bool)
  if shape.causal:  # bottom-right: row i sees keys <= i + s - t
    hidden = k_lo > q_hi - 1 + (s - t)
  mask = mask_kw.get("mask")
  if isinstance(mask, jaxflash.FlashMask):
    bounds = mask.check(shape.batch, shape.heads, t, s).tile_bounds(block)
    bounds = type(bounds)(*(x[:, :, None, :] for x in bounds))
    cls = flashmask.tile_class(bounds, q_lo, q_hi)
    return float(jnp.mean(hidden | (cls == flashmask.TILE_HIDDEN)))
  if "local_window_size" in mask_kw:
    left, right = mask_kw["local_window_size"]
    k_hi = jnp.minimum(k_lo + block, s) - 1
    # Every pair's key outside [i + off - left, i + off + right].
    off = s - t
    hidden = hidden | (k_hi < q_lo + off - left) | (k_lo > q_hi - 1 + off
                                                      + right)
    return float(jnp.mean(hidden))
  if "segment_ids" in mask_kw:
    ids = mask_kw["segment_ids"]
    vis = ids[:, :, None] == ids[:, None, :]
  else:
    vis = mask  # dense [B|1, H|1, T, S]
  vis = jnp.pad(vis.reshape(-1, t, s), ((0, 0), (0, nq * block - t),
                                        (0, nk * block - s)))
  any_vis = vis.reshape(-1, nq, block, nk, block).any(axis=(2, 4))
  return float(jnp.mean(hidden | ~any_vis))


def mask_kwargs(shape: Shape) -> dict:
  """flash_attention keywords for the shape's mask description."""
  if shape.mask is None:
    return {}
  if shape.mask == "bias":  # one [T, S] bias per head, as T5's or ALiBi's
    bias = jax.random.normal(jax.random.key(7), (1, shape.heads, shape.seq_q,
                                                 shape.seq_k))
    return dict(bias=bias.astype(shape.jnp_dtype))
  kind, _, arg = shape.mask.partition(":")
  n = int(arg)
  if kind == "window":
    return dict(local_window_size=(n, 0 if shape.causal else n))
  if kind == "dropout":  # n percent; the key fixed, so each run drops alike
    return dict(dropout_rate=n / 100, dropout_rng=jax.random.key(11))
  # segments:N - N equal documents per row (the last one takes the rest).
  doc = max(1, shape.seq_q // n)
  ids = jnp.minimum(jnp.arange(shape.seq_q, dtype=jnp.int32) // doc, n - 1)
  rows = lambda x: jnp.broadcast_to(x, (shape.batch, shape.seq_q))
  fm = jaxflash.FlashMask
  if kind == "flashmask-doc":  # N causal documents
    return dict(mask=fm.causal_document(rows(ids)))
  if kind == "flashmask-prefix":  # bidirectional prefix of seq / N
    return dict(mask=fm.prefix_lm(jnp.full((shape.batch,), shape.seq_q // n,
                                           jnp.int32), shape.seq_q))
  if kind == "flashmask-question":  # a question, then N equal answers
    part = max(1, shape.seq_q // (n + 1))
    answers = jnp.minimum(jnp.arange(shape.seq_q, dtype=jnp.int32) // part,
                          n)
    return dict(mask=fm.shared_question(rows(answers)))
  if kind == "flashmask-window":  # 64 global tokens, causal window of n
    return dict(mask=fm.global_and_window(shape.seq_q, 64, n))
  if kind == "flashmask-block":  # N bidirectional documents
    return dict(mask=fm.document(rows(ids)))
  if kind == "dense-segments":  # the same documents as a [B, 1, T, S] mask
    same = ids[:, None] == ids[None, :]
    return dict(mask=jnp.broadcast_to(same, (shape.batch, 1, shape.seq_q,
                                             shape.seq_k)))
  return dict(segment_ids=jnp.broadcast_to(ids, (shape.batch, shape.seq_q)))
