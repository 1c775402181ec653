# A call on an H200 or an H100 (s38), about 500 s:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s38-gpu.sh
# (XDIST=4 on an H100.)  s38-gpu-short.sh (s38's head_dim 64 non-causal
# rule: its gpu tests, its check against the old default, the head_dim
# 64 grid), then on an H200 the rest of the forward grid (head_dim 128
# and 256, 7 rounds); on an H100 (whose head_dim 128/256 grid ran at
# kernels fingerprint-equal to this commit's in s38) head_dim 64 causal
# variants at 4096-16384 keys, where tokamax leads there (0.95-0.98).
. tools/plans/s38-gpu-short.sh
if nvidia-smi -L | grep -q H200; then
  for d in 128 256; do
    bench_stage grid-d$d 120 --impls $I --mode fwd --head-dims $d \
      --causal both --samples 7
  done
else
  bench_stage d64c-long-variants 120 --impls $I --mode fwd --head-dims 64 \
    --seqs 4096,8192,16384 --causal on --samples 7 \
    --mosaic-variants "x:stages=2;p:persistent=1;pdq:persistent=1,prefetch_q=1,q_double_buffer=1;w3:compute_wgs=3;s3:stages=3"
fi
