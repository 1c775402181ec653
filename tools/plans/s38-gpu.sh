# A call on an H200 or an H100 (s38), about 480 s:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s38-gpu.sh
# (XDIST=4 on an H100.)  s38's head_dim 64 non-causal rule (two Q buffers
# and the plain loop run on across items at 1025-2048 keys): its gpu
# tests (the default on 512 items at 1024/2000/2048 keys, the default
# path at 2000 keys, the item-overlap configs), the rule against the
# old default (old) and a copy (x), with the causal 2048-key lever
# (pqdq) alongside; then, on an H200, the whole forward grid in rounds;
# on an H100 (whose d128/d256 grid ran at kernels fingerprint-equal to
# this commit's earlier in s38) the d64 grid and head_dim 64 causal
# variants at 4096-16384 keys, where tokamax leads there (0.95-0.98).
test_stage d64nc-rule-tests 150 tests/test_mosaic_gpu.py \
  -k "test_gpu_long_persistent_default_items or (test_gpu_long and 64-False-2000) or (test_gpu_long_persistent_items and 64 and item-overlap) or d64-full-default"
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
bench_stage d64-rule 70 --impls $I --mode fwd --head-dims 64 \
  --seqs 2048 --causal both --samples 9 \
  --mosaic-variants "x:stages=2;old:item_overlap=0,q_double_buffer=0;pqdq:prefetch_q=1,q_double_buffer=1"
if nvidia-smi -L | grep -q H200; then
  for d in 64 128 256; do
    bench_stage grid-d$d 120 --impls $I --mode fwd --head-dims $d \
      --causal both --samples 7
  done
else
  bench_stage grid-d64 100 --impls $I --mode fwd --head-dims 64 \
    --causal both --samples 7
  bench_stage d64c-long-variants 120 --impls $I --mode fwd --head-dims 64 \
    --seqs 4096,8192,16384 --causal on --samples 7 \
    --mosaic-variants "x:stages=2;p:persistent=1;pdq:persistent=1,prefetch_q=1,q_double_buffer=1;w3:compute_wgs=3;s3:stages=3"
fi
