"""tools/sass_loops.py finds a kernel's tile loops in nvdisasm's listing
(the parser; the listing below is shaped as nvdisasm prints a Mosaic GPU
forward: a tile loop with a predicated forward branch, a barrier wait
whose retry block sits after the code, and an outer loop)."""

import pathlib

SASS = """\
        /*0000*/      S2R R14, SR_TID.X ;          /* 0x0 */
.L_x_1:
        /*0010*/      IADD3 R1, R1, 0x1, RZ ;      /* 0x0 */
.L_x_2:
        /*0020*/      SYNCS.PHASECHK.TRANS64.TRYWAIT P3, [UR7], R152 ;
        /*0030*/      @!P3 BRA `(.L_x_9) ;
.L_x_3:
        /*0040*/      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0050*/      FMNMX.NAN R5, R6, R7, !PT ;
        /*0060*/      MUFU.EX2 R5, R5 ;
        /*0070*/      VOTE.ANY P2, P2 ;
        /*0080*/      @!P2 BRA `(.L_x_4) ;
        /*0090*/      FMUL R24, R24, R5 ;
        /*00a0*/      FMUL R25, R25, R5 ;
        /*00b0*/      FMUL R26, R26, R5 ;
.L_x_4:
        /*00c0*/      HGMMA.64x256x16.F32.BF16 R24, R184, gdesc[UR8], R24 ;
        /*00d0*/      @P1 BRA `(.L_x_2) ;
        /*00e0*/      @P0 BRA `(.L_x_1) ;
        /*00f0*/      EXIT ;
.L_x_9:
        /*0100*/      NANOSLEEP.SYNCS 0x0 ;
        /*0110*/      SYNCS.PHASECHK.TRANS64 P3, [UR7], R152 ;
        /*0120*/      @!P3 BRA `(.L_x_9) ;
        /*0130*/      BRA `(.L_x_3) ;
"""


def test_tile_loop_counts_and_skip(monkeypatch):
  monkeypatch.syspath_prepend(pathlib.Path(__file__).parents[1] / "tools")
  import sass_loops

  every = sass_loops.loops(SASS)
  spans = sorted((l.start, l.end) for l in every)
  # The tile loop, the outer loop, the retry spin, and the retry block's
  # branch back into the tile loop (not a loop of the kernel).
  assert spans == [(0x10, 0xe0), (0x20, 0xd0), (0x40, 0x130), (0x100, 0x120)]
  (tile,) = sass_loops.tile_loops(every)
  assert (tile.start, tile.end, tile.count) == (0x20, 0xd0, 12)
  assert tile.skip == 3  # the three FMULs behind the vote
  assert tile.opcodes["FMUL"] == 3 and tile.opcodes["BRA"] == 3
  assert tile.as_row()["taken"] == 9


def test_opcode_strips_predicates(monkeypatch):
  monkeypatch.syspath_prepend(pathlib.Path(__file__).parents[1] / "tools")
  import sass_loops

  assert sass_loops.opcode("@!P3 FMNMX.NAN R1, R2, R3, !PT") == "FMNMX.NAN"
  assert sass_loops.opcode("@!UP1 BRA P2, `(.L_x_12)") == "BRA"
  assert sass_loops.opcode("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ") \
      == "HGMMA.64x64x16.F32.BF16"
