"""Byte-level tokens from a corpus every machine has, packed with segment ids.

Default corpus: the Python standard library of the running interpreter
(its ``.py`` files; no download). ``--data PATH`` takes a text file or a
folder of them. Each file is a document; documents are concatenated into
fixed-length rows and cut where a row ends, and ``segment_ids`` number the
documents inside each row, so attention never crosses a document boundary.
The split is deterministic: every 20th document goes to validation.
"""

from __future__ import annotations

import os
import sysconfig

import numpy as np

VOCAB = 256  # bytes


def stdlib_files(limit_bytes: int | None = None) -> list[str]:
  """Sorted ``.py`` files of the standard library (no site-packages)."""
  root = sysconfig.get_paths()["stdlib"]
  files, total = [], 0
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames
                         if d not in ("site-packages", "test", "tests",
                                      "idlelib", "__pycache__"))
    for name in sorted(filenames):
      if name.endswith(".py"):
        path = os.path.join(dirpath, name)
        files.append(path)
        total += os.path.getsize(path)
    if limit_bytes is not None and total >= limit_bytes:
      break
  return files


def text_files(path: str) -> list[str]:
  if os.path.isfile(path):
    return [path]
  out = []
  for dirpath, dirnames, filenames in os.walk(path):
    dirnames.sort()
    out += [os.path.join(dirpath, f) for f in sorted(filenames)]
  return out


def load_documents(path: str | None = None,
                   limit_bytes: int | None = None) -> list[bytes]:
  files = text_files(path) if path else stdlib_files(limit_bytes)
  docs = []
  for f in files:
    with open(f, "rb") as fh:
      data = fh.read()
    if data:
      docs.append(data)
  if not docs:
    raise ValueError(f"no documents found at {path!r}")
  return docs


def rechunk(docs: list[bytes], size: int) -> list[bytes]:
  """The corpus joined and cut into documents of ``size`` bytes (the last
  one shorter).  For long-context runs: the default corpus's files are a
  few KiB each, so a 131072-token row would hold dozens of documents and
  the kernels would skip almost every key block (segment ids); documents
  of at least ``seq_len`` bytes make each row's attention (nearly) full
  causal attention over the row."""
  if size < 1:
    raise ValueError(f"document size must be positive, got {size}")
  blob = b"".join(docs)
  return [blob[i:i + size] for i in range(0, len(blob), size)]


def split(docs: list[bytes]) -> tuple[list[bytes], list[bytes]]:
  """Deterministic train/validation split: every 20th document validates."""
  train = [d for i, d in enumerate(docs) if i % 20 != 19]
  val = [d for i, d in enumerate(docs) if i % 20 == 19]
  return train, val or train[:1]


def pack(docs: list[bytes], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Rows of ``seq_len + 1`` tokens (inputs and shifted targets) with
  segment ids 1, 2, ... numbering the documents within each row."""
  row = seq_len + 1
  stream = np.frombuffer(b"".join(docs), dtype=np.uint8)
  doc_ids = np.repeat(np.arange(len(docs), dtype=np.int64),
                      [len(d) for d in docs])
  n = len(stream) // row
  if n == 0:
    raise ValueError(f"corpus of {len(stream)} bytes is shorter than one"
                     f" row of {row}")
  tokens = stream[:n * row].reshape(n, row).astype(np.int32)
  ids = doc_ids[:n * row].reshape(n, row)
  # Renumber per row from 1 (documents can start mid-row).
  seg = (ids - ids[:, :1] + 1).astype(np.int32)
  return tokens, seg


class Batches:
  """Deterministic shuffled batches over packed rows; each process takes
  its slice of every global batch (``process_index`` of ``process_count``).
  """

  def __init__(self, tokens, seg, batch_size: int, seed: int = 0,
               process_index: int = 0, process_count: int = 1):
    if batch_size % process_count:
      raise ValueError(f"batch_size={batch_size} not divisible by"
                       f" {process_count} processes")
    self.tokens, self.seg = tokens, seg
    self.batch_size, self.seed = batch_size, seed
    self.local = batch_size // process_count
    self.offset = process_index * self.local

  def get(self, step: int):
    """The batch of ``step`` (same on resume): this process's rows."""
    n = len(self.tokens)
    epoch, pos = divmod(step * self.batch_size, n)
    perm = np.random.default_rng(self.seed + epoch).permutation(n)
    idx = perm[(pos + np.arange(self.batch_size)) % n]
    idx = idx[self.offset:self.offset + self.local]
    return self.tokens[idx], self.seg[idx]
