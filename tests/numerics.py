"""The FlashAttention numerics rule (docs/numerics.md), shared by tests.

``ref32``: the reference on float32 inputs at HIGHEST precision.
``ref_lp``: the same reference computed in the input dtype.
A result passes when ``max|out - ref32| <= 2 * max|ref_lp - ref32| + floor``
for the output, the log-sum-exp and every gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import reference

# Floors, relative to the largest magnitude of the float32 reference:
# about one unit in the last place of each dtype (float32 also allows for
# a different summation order over up to a few thousand terms).
FLOOR = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2 ** -8,
         jnp.dtype(jnp.float16): 2 ** -10}

NAMES = ("out", "lse", "dq", "dk", "dv")


def random_inputs(key, *, batch, q_len, kv_len, heads, kv_heads, head_dim,
                  dtype):
  kq, kk, kv, kdo, kdl = jax.random.split(key, 5)
  q = jax.random.normal(kq, (batch, q_len, heads, head_dim), jnp.float32)
  k = jax.random.normal(kk, (batch, kv_len, kv_heads, head_dim), jnp.float32)
  v = jax.random.normal(kv, (batch, kv_len, kv_heads, head_dim), jnp.float32)
  do = jax.random.normal(kdo, (batch, q_len, heads, head_dim), jnp.float32)
  dlse = jax.random.normal(kdl, (batch, heads, q_len), jnp.float32)
  return (q.astype(dtype), k.astype(dtype), v.astype(dtype), do.astype(dtype),
          dlse)


def outputs_and_grads(fn, q, k, v, do, dlse):
  """(out, lse, dq, dk, dv) of ``fn(q, k, v) -> (out, lse)`` via jax.vjp.

  Jitted as a whole: op-by-op dispatch would compile every primitive of the
  reference separately, which costs tens of seconds per shape on a GPU.
  """
  @jax.jit
  def run(q, k, v, do, dlse):
    (out, lse), vjp = jax.vjp(fn, q, k, v)
    dq, dk, dv = vjp((do.astype(out.dtype), dlse))
    return out, lse, dq, dk, dv
  return run(q, k, v, do, dlse)


def max_abs_diff(a, b) -> float:
  """max |a - b| over entries; infinities must agree exactly."""
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  inf_a, inf_b = np.isinf(a), np.isinf(b)
  if not np.array_equal(inf_a, inf_b) or not np.array_equal(a[inf_a],
                                                            b[inf_b]):
    return float("inf")
  fin = ~inf_a
  if not fin.any():
    return 0.0
  d = np.abs(a[fin] - b[fin])
  return float("nan") if np.isnan(d).any() else float(d.max())


# reference.attention's keywords that are arrays (traced); the others are
# static, part of the key of the jitted reference's compile cache.
_ARRAY_KWARGS = ("segment_ids", "q_seq_lengths", "kv_seq_lengths", "bias",
                 "dense_mask", "dropout_seeds")


@functools.partial(jax.jit, static_argnames=("static",))
def _reference_vjp(q, k, v, do, dlse, arrays, *, static):
  kw = dict(static, **arrays)
  (out, lse), vjp = jax.vjp(
      lambda q, k, v: reference.attention(q, k, v, **kw), q, k, v)
  dq, dk, dv = vjp((do.astype(out.dtype), dlse))
  return out, lse, dq, dk, dv


def reference_outputs_and_grads(q, k, v, do, dlse, **ref_kwargs):
  """(out, lse, dq, dk, dv) of jaxflash.reference.attention, as
  :func:`outputs_and_grads` gives them, jitted once per shape and static
  options (one module-level jit, not one per call): tests that share a
  configuration pay its compile once."""
  arrays = {n: ref_kwargs.pop(n) for n in _ARRAY_KWARGS if n in ref_kwargs}
  if "window" in ref_kwargs:
    ref_kwargs["window"] = tuple(ref_kwargs["window"])
  return _reference_vjp(q, k, v, do, dlse, arrays,
                        static=tuple(sorted(ref_kwargs.items())))


@functools.partial(jax.jit, static_argnames=("static",))
def _reference_forward(q, k, v, arrays, *, static):
  return reference.attention(q, k, v, **dict(static, **arrays))


def reference_attention(q, k, v, **ref_kwargs):
  """jaxflash.reference.attention, jitted once per shape and static
  options (see :func:`reference_outputs_and_grads`)."""
  arrays = {n: ref_kwargs.pop(n) for n in _ARRAY_KWARGS if n in ref_kwargs}
  if "window" in ref_kwargs:
    ref_kwargs["window"] = tuple(ref_kwargs["window"])
  return _reference_forward(q, k, v, arrays,
                            static=tuple(sorted(ref_kwargs.items())))


def check_rule(got, q, k, v, do, dlse, **ref_kwargs):
  """Asserts the numerics rule for ``got = (out, lse, dq, dk, dv)``."""
  dtype = jnp.dtype(q.dtype)
  f32 = lambda x: x.astype(jnp.float32)
  ref32 = reference_outputs_and_grads(f32(q), f32(k), f32(v), f32(do), dlse,
                                      **ref_kwargs)
  if dtype == jnp.float32:
    ref_lp = ref32  # the same computation (the reference's float32 path)
  else:
    ref_lp = reference_outputs_and_grads(q, k, v, do, dlse, upcast=False,
                                         **ref_kwargs)
  failures = []
  for name, g, r32, rlp in zip(NAMES, got, ref32, ref_lp):
    if np.isnan(np.asarray(g, np.float32)).any():
      failures.append(f"{name}: NaN in result")
      continue
    scale = float(np.max(np.abs(np.nan_to_num(np.asarray(r32, np.float64),
                                              posinf=0, neginf=0))))
    err = max_abs_diff(g, r32)
    lp_err = max_abs_diff(rlp, r32)
    if not np.isfinite(lp_err):
      lp_err = 0.0  # low-precision reference overflowed: judge on floor
    tol = 2 * lp_err + FLOOR[dtype] * max(scale, 1.0)
    if not err <= tol:
      failures.append(f"{name}: err {err:.3g} > tol {tol:.3g}"
                      f" (ref_lp err {lp_err:.3g}, scale {scale:.3g})")
  assert not failures, "; ".join(failures)


def reference_kwargs(causal=False, segment_ids=None, local_window_size=None,
                     q_seq_lengths=None, kv_seq_lengths=None,
                     logits_soft_cap=None, softmax_scale=None):
  """flash_attention's mask keywords -> jaxflash.reference.attention's."""
  kw = dict(causal=causal, q_seq_lengths=q_seq_lengths,
            kv_seq_lengths=kv_seq_lengths, logits_soft_cap=logits_soft_cap,
            softmax_scale=softmax_scale)
  if segment_ids is not None:
    kw["segment_ids"] = (tuple(segment_ids)
                         if isinstance(segment_ids, (tuple, list))
                         else (segment_ids, segment_ids))
  if local_window_size is not None:
    w = local_window_size
    kw["window"] = (w, w) if isinstance(w, int) else tuple(w)
  return kw
