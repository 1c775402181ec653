"""jaxflash.autotune: candidates timed, the winner cached on disk by device
kind, jax version and class of call, and used by later calls of the class
that pass no config (the cache is off in every other test: conftest)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

import jaxflash
from jaxflash import masks
from jaxflash.mosaic_gpu import autotuned
from jaxflash.mosaic_gpu import backend as mosaic_backend
from jaxflash.mosaic_gpu.config import INTERPRET_CONFIG, default_config
from jaxflash.tune import candidate_configs


@pytest.fixture
def cache(tmp_path, monkeypatch):
  path = tmp_path / "autotune.json"
  monkeypatch.setenv(autotuned.ENV, str(path))
  return path


def _arrays(b=1, t=128, h=2, kh=1, d=64):
  ks = jax.random.split(jax.random.key(3), 3)
  return (jax.random.normal(ks[0], (b, t, h, d), jnp.bfloat16),
          jax.random.normal(ks[1], (b, t, kh, d), jnp.bfloat16),
          jax.random.normal(ks[2], (b, t, kh, d), jnp.bfloat16))


def test_autotune_times_candidates_and_later_calls_use_the_winner(
    cache, monkeypatch):
  """In the interpreter (its times mean nothing; the mechanism is what is
  checked): the winner is one of the candidates, stored under this device
  kind and jax version, and a later call of the class (another length in
  the same power-of-two bucket) that passes no config resolves to it,
  where a call of another class gets the tuned default."""
  q, k, v = _arrays()
  other = dataclasses.replace(INTERPRET_CONFIG, block_kv=128)
  won = jaxflash.autotune(q, k, v, causal=True, mode="fwd",
                          candidates=[INTERPRET_CONFIG, other], samples=1,
                          min_sample_s=0.0, interpret=True)
  assert won in (INTERPRET_CONFIG, other)
  data = json.loads(cache.read_text())
  kind = jax.devices()[0].device_kind
  stored = data["entries"][kind][jax.__version__]
  key = "bfloat16-d64-causal-g2-bh128-q128-k128"
  assert stored == {key: dataclasses.asdict(won)}
  # A later call of the class: the backend resolves its config from the
  # cache (on a GPU of this kind; here the kind is the CPU's).
  monkeypatch.setattr(mosaic_backend, "_device_kind", lambda: kind)
  q2 = jax.ShapeDtypeStruct((1, 100, 2, 64), jnp.bfloat16)
  k2 = jax.ShapeDtypeStruct((1, 100, 1, 64), jnp.bfloat16)
  spec = masks.MaskSpec(100, 100, True)
  assert mosaic_backend.autotune_key(q2, k2, spec) == key
  got = mosaic_backend._resolve_config(None, False, 64, spec, q=q2, k=k2)
  assert got == won
  # Another class (not causal): the tuned default.
  full = masks.MaskSpec(100, 100, False)
  assert mosaic_backend._resolve_config(None, False, 64, full, q=q2,
                                        k=k2) == default_config(
                                            kind, 64, kv_len=100)


def test_cache_off_unreadable_or_stale_is_ignored(cache, monkeypatch):
  kind = jax.devices()[0].device_kind
  key = "bfloat16-d64-full-g1-bh128-q128-k128"
  cfg = dataclasses.replace(INTERPRET_CONFIG, stages=3)
  assert autotuned.store(kind, key, cfg) == str(cache)
  assert autotuned.lookup(kind, key) == cfg
  assert autotuned.lookup("another GPU", key) is None
  monkeypatch.setenv(autotuned.ENV, "off")
  assert autotuned.cache_path() is None
  assert autotuned.lookup(kind, key) is None
  assert autotuned.store(kind, key, cfg) is None
  monkeypatch.setenv(autotuned.ENV, str(cache))
  cache.write_text("{ not json")
  assert autotuned.lookup(kind, key) is None
  stale = {"entries": {kind: {jax.__version__: {key: {"no_such_field": 1}}}}}
  cache.write_text(json.dumps(stale))
  assert autotuned.lookup(kind, key) is None
  bad = {"entries": {kind: {jax.__version__: {key: {"block_q": 32}}}}}
  cache.write_text(json.dumps(bad))
  assert autotuned.lookup(kind, key) is None


def test_call_classes():
  q = jax.ShapeDtypeStruct((8, 3000, 16, 96), jnp.float16)
  k = jax.ShapeDtypeStruct((8, 3000, 4, 96), jnp.float16)
  assert autotuned.call_class(q, k, causal=True, window=True) == (
      "float16-d96-causal-window-g4-bh128-q4096-k4096")
  q80 = jax.ShapeDtypeStruct((1, 577, 12, 72), jnp.bfloat16)
  assert autotuned.call_class(q80, q80, causal=False, window=False) == (
      "bfloat16-d80-full-g1-bh128-q1024-k1024")


def test_candidates_are_valid_and_distinct():
  base = default_config("NVIDIA H200", 128, causal=True, kv_len=8192)
  got = candidate_configs(base, head_dim=128, causal=True, group_size=8,
                          mode="fwd_bwd")
  assert got[0] == base and len(set(got)) == len(got) > 5
  assert any(c.bwd_head_splits == 1 for c in got)
  assert any(c.persistent != base.persistent for c in got)
  assert any(c.persistent and c.causal_lpt != base.causal_lpt for c in got)
  fwd = candidate_configs(base, head_dim=128, causal=True, group_size=8,
                          mode="fwd")
  assert all(c.bwd_head_splits is None for c in fwd)
  wide = default_config("NVIDIA H200", 256, kv_len=4096)
  assert all(c.compute_wgs != 3 for c in candidate_configs(
      wide, head_dim=256, causal=False, group_size=1, mode="fwd"))


def test_autotune_checks_its_arguments():
  q, k, v = _arrays()
  with pytest.raises(ValueError, match="mode='bwd'"):
    jaxflash.autotune(q, k, v, mode="bwd")
  with pytest.raises(ValueError, match="samples=0"):
    jaxflash.autotune(q, k, v, samples=0)
