# A short call on an H200 or an H100 (s38), about 300 s, for what device
# time s38 had left:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s38-gpu-short.sh
# (XDIST=4 on an H100.)  s38's head_dim 64 non-causal 1025-2048-key
# rule: its gpu tests (s38-gpu-tests.sh), the rule against the old
# default (old) and a copy (x), with the causal 2048-key lever (pqdq)
# alongside; then the head_dim 64 forward grid (the only head_dim whose
# kernels changed since the s38 H100 grid at 3c947de).
. tools/plans/s38-gpu-tests.sh
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
bench_stage d64-rule 70 --impls $I --mode fwd --head-dims 64 \
  --seqs 2048 --causal both --samples 9 \
  --mosaic-variants "x:stages=2;old:item_overlap=0,q_double_buffer=0;pqdq:prefetch_q=1,q_double_buffer=1"
bench_stage grid-d64 100 --impls $I --mode fwd --head-dims 64 \
  --causal both --samples 7
