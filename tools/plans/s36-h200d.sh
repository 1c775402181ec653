# A fourth H200 call (docs/perf-notes.md, "Next (thirty-sixth session's
# view)"), about 520 s, after s36-h200a.sh has run split_tail's gpu tests:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s36-h200d.sh
# split_tail where the default is the plain grid: non-causal calls from
# 4096 keys at head_dim 64 (three consumers) and 128.  On the plain grid
# the last wave's blocks run on part of the SMs as on the persistent one;
# split_tail needs the persistent grid, so `p` (persistent alone) is the
# control that separates the grid's cost from the split's gain.  At
# head_dim 128 from 8192 keys the default's 176-key tiles leave no shared
# memory for prefetch_q's slots: `pst` there turns prefetch_q off.  The
# bench checks every row against the reference (three consumers with
# split_tail have no gpu test of their own).
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
T="NVIDIA H200"
V="h200:stages=2;x:stages=2;p:persistent=1;pst:persistent=1,split_tail=1"
bench_stage d64nc-long-rounds 250 --impls $I --mode fwd --tuned-for "$T" \
  --head-dims 64 --seqs 4096,8192,16384 --causal off --samples 5 \
  --mosaic-variants "$V"
V="h200:stages=2;x:stages=2;p:persistent=1,prefetch_q=0"
V="$V;pst:persistent=1,prefetch_q=0,split_tail=1"
# With prefetch_q (the persistent 2048-key calls' form): 4096 keys only,
# the 176-key tiles refuse it (the rows say so).
V="$V;pq:persistent=1;pqst:persistent=1,split_tail=1"
bench_stage d128nc-long-rounds 250 --impls $I --mode fwd --tuned-for "$T" \
  --head-dims 128 --seqs 4096,8192,16384 --causal off --samples 5 \
  --mosaic-variants "$V"
