"""tools/ptxas_report.py reads ptxas' verbose report (the parser; the
compilation itself needs an sm90 GPU)."""

import argparse
import pathlib

import pytest

REPORT = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'fwd_kernel' for 'sm_90a'
ptxas info    : Function properties for fwd_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
ptxas info    : Compiling entry function 'bwd_kernel' for 'sm_90a'
ptxas info    : Function properties for bwd_kernel
    8 bytes stack frame, 40 bytes spill stores, 64 bytes spill loads
ptxas warning : Registers are spilled to local memory in function \
'bwd_kernel', 40 bytes spill stores, 64 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
"""


def test_parse_entries_spills_and_warnings(monkeypatch):
  monkeypatch.syspath_prepend(pathlib.Path(__file__).parents[1] / "tools")
  import ptxas_report

  fwd, bwd = ptxas_report.parse(REPORT)
  assert fwd == dict(entry="fwd_kernel", warnings=[], registers=168,
                     spill_stores=0, spill_loads=0, stack=0)
  assert (bwd["entry"], bwd["registers"], bwd["spill_stores"],
          bwd["spill_loads"], bwd["stack"]) == ("bwd_kernel", 168, 40, 64, 8)
  assert len(bwd["warnings"]) == 1 and "spilled" in bwd["warnings"][0]


def test_parse_warning_before_any_entry(monkeypatch):
  monkeypatch.syspath_prepend(pathlib.Path(__file__).parents[1] / "tools")
  import ptxas_report

  (only,) = ptxas_report.parse(
      "ptxas warning : Potential Performance Loss: wgmma.mma_async"
      " instructions are serialized\n")
  assert only["entry"] == "?" and "serialized" in only["warnings"][0]


# CUDA 13's ptxas (as Mosaic GPU's MOSAIC_GPU_DUMP_PTXAS files show, one
# per kernel): a kernel's notes and warnings come before its entry line.
REPORT_13 = """\
ptxas info    : (C7517) warpgroup.wait is injected in around line 609 by \
compiler to allow use of registers defined by GMMA in function 'dkv'
ptxas warning : Registers are spilled to local memory in function 'dkv', \
152 bytes spill stores, 160 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'dkv' for 'sm_90a'
ptxas info    : Function properties for dkv
    160 bytes stack frame, 152 bytes spill stores, 160 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'dq' for 'sm_90a'
ptxas info    : Function properties for dq
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
"""


def test_parse_notes_before_their_entry(monkeypatch):
  monkeypatch.syspath_prepend(pathlib.Path(__file__).parents[1] / "tools")
  import ptxas_report

  dkv, dq = ptxas_report.parse(REPORT_13)
  assert (dkv["entry"], dkv["spill_stores"], dkv["spill_loads"]) == (
      "dkv", 152, 160)
  assert len(dkv["warnings"]) == 2 and "C7517" in dkv["warnings"][0]
  assert dq["entry"] == "dq" and dq["warnings"] == []
  assert dq["spill_stores"] == 0


def test_ptxas_cpu_lowers_and_names_the_kernels(monkeypatch):
  """tools/ptxas_cpu.py's first half, which needs neither the CUDA plugin
  nor ptxas: the kernel modules of a call in lowering order, named by
  pass (the forward, then the backward's dQ before its dK/dV)."""
  monkeypatch.syspath_prepend(pathlib.Path(__file__).parents[1] / "tools")
  import ptxas_cpu

  spec = dict(head_dim=128, mode="fwd_bwd", causal=False, overrides="",
              seq=256, kv_len_rule=8192, device_kind="NVIDIA H200")
  cfg, modules, names = ptxas_cpu.lower(spec)
  assert cfg.block_kv == 176 and not cfg.intra_wg_overlap
  assert names == ["forward", "dq", "dkv"]
  assert len(modules) == 3 and all(isinstance(m, bytes) for m in modules)
  spec.update(mode="fwd", causal=True, overrides="consumer_registers=232")
  cfg, modules, names = ptxas_cpu.lower(spec)
  assert cfg.intra_wg_overlap and cfg.consumer_registers == 232
  assert names == ["forward"] and len(modules) == 1


def test_ptxas_cpu_tokamax_cases(monkeypatch):
  """--tokamax takes forward cases without overrides (tokamax picks its
  own config) and lowers tokamax's one forward kernel, where tokamax is
  importable (the anchor wheels; skipped in CI)."""
  monkeypatch.syspath_prepend(pathlib.Path(__file__).parents[1] / "tools")
  import ptxas_cpu

  a = argparse.Namespace(seq=256, batch=1, kv_len_rule=8192,
                         device_kind="NVIDIA H200", arch="sm_90a",
                         loops=False, tokamax=True, sms=132)
  for bad in ("128:fwd_bwd:0:", "128:fwd:0:block_kv=64"):
    with pytest.raises(SystemExit, match="--tokamax takes MODE fwd"):
      ptxas_cpu.case_spec(bad, a)
  spec = ptxas_cpu.case_spec("128:fwd:1:", a)
  assert spec["tokamax"] and spec["causal"] and spec["sms"] == 132
  pytest.importorskip("tokamax")
  cfg, modules, names = ptxas_cpu.lower(spec)
  assert cfg is None and names == ["tokamax"] and len(modules) == 1
  assert isinstance(modules[0], bytes)


# A two-launch ncu source page (--page source --csv --print-source sass),
# cut to the columns tools/ncu_stalls.py reads.
_HEADER = ('"Address","Source","Instructions Executed",'
           '"Warp Stall Sampling (All Samples)","stall_wait"')
SOURCE_PAGE = "\n".join([
    '"Kernel Name","first"', _HEADER,
    '"0","@P0 FMUL R1, R1, R2","100","5","5"',
    '"1","FMUL.FTZ R3, R3, R2","50","1","1"',
    '"2","MUFU.EX2 R4, R4","40","2","2"',
    '"3","@!UP1 BRA 0x10","7","0","0"',
    '"Kernel Name","second"', _HEADER,
    '"0","FFMA R1, R1, R2, R3","9","1","1"', ""])


def test_ncu_stalls_counts_opcodes_per_kernel(monkeypatch, tmp_path, capsys):
  """--opcodes sums each opcode's executions over its SASS lines
  (predicates and modifiers dropped), per launch, and --per divides."""
  monkeypatch.syspath_prepend(pathlib.Path(__file__).parents[1] / "tools")
  import ncu_stalls

  page = tmp_path / "page.csv"
  page.write_text(SOURCE_PAGE)
  _, rows = ncu_stalls.load(page, 0)
  assert ncu_stalls.opcode_counts(rows) == {"FMUL": 150, "MUFU": 40,
                                            "BRA": 7}
  _, rows = ncu_stalls.load(page, 1)
  assert ncu_stalls.opcode_counts(rows) == {"FFMA": 9}
  ncu_stalls.main([str(page), "--opcodes", "2", "--per", "10"])
  out = capsys.readouterr().out.splitlines()
  assert out[0] == "197 warp-level instructions executed, 19.7 per 10"
  assert out[1].split()[:2] == ["FMUL", "15.0"]
  assert out[2].split()[:2] == ["MUFU", "4.0"]
