# The third call of s39 (an H100), about 150 s:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s39-gpu-c.sh
# (XDIST=4 on an H100.)  The H100's persistent head_dim 64 causal rule
# from 16384 keys: its gpu test (with the rest of the H100 forms), then
# the new default against the H200 entry's (old, by --tuned-for) and
# the persistent grid at 8192 keys (p).
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
test_stage d64-rule-tests 200 tests/test_mosaic_gpu.py \
  -k "test_gpu_h100_three_consumers"
bench_stage d64c-long 100 --impls $I --mode fwd --head-dims 64 \
  --seqs 8192,16384 --causal on --samples 9 --tuned-for "NVIDIA H200" \
  --mosaic-variants "old:stages=2;h100p:compute_wgs=3,persistent=1"
