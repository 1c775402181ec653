# The second call of s39 (on an H100 or an H200), about 450 s:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s39-gpu-b.sh
# (XDIST=4 on an H100.)  The rest of the forward grid at this commit
# (head_dim 128 with three consumers alongside, w3, and 256); on an
# H100 the head_dim 64 causal 16384-key call (the one below 1.0 there in
# s39's first call) with the persistent grid (p, pdq) alongside; on an
# H200 the head_dim 64 grid too.
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
bench_stage grid-d128 160 --impls $I --mode fwd --head-dims 128 \
  --causal both --samples 7 --mosaic-variants "w3:compute_wgs=3"
bench_stage grid-d256 120 --impls $I --mode fwd --head-dims 256 \
  --causal both --samples 7
if nvidia-smi -L | grep -q H200; then
  bench_stage grid-d64 120 --impls $I --mode fwd --head-dims 64 \
    --causal both --samples 7
else
  bench_stage d64c-16384 80 --impls $I --mode fwd --head-dims 64 \
    --seqs 16384 --causal on --samples 9 \
    --mosaic-variants "x:stages=2;p:persistent=1;pdq:persistent=1,prefetch_q=1,q_double_buffer=1"
fi
