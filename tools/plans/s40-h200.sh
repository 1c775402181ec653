# s39's next call (about 200 s on an H200, 100 s on an H100):
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s40-h200.sh
# (XDIST=4 on an H100.)  First the gpu configs of the H100's head_dim 64
# forms over every case (added in s39 after its runs: three consumers
# on the persistent grid, and with two Q buffers and the chained loop).
# Then, on an H200, three head_dim 64 consumers (the H100's rules since
# s39) against the H200 entry's default at 1024-16384 keys, causal and
# not, with the persistent grid alongside (w3p; for causal calls from
# 4097 keys).  The H100 ran the comparison in s39.
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
test_stage three-wg-configs 150 tests/test_mosaic_gpu.py \
  -k "test_gpu and (named-three-wg-persistent-unpadded-q or named-three-wg-double-q-item-overlap-unpadded-q)"
if nvidia-smi -L | grep -q H200; then
  bench_stage d64-w3-h200 220 --impls $I --mode fwd --head-dims 64 \
    --seqs 1024,2048,4096,8192,16384 --causal both --samples 7 \
    --mosaic-variants "x:stages=2;w3:compute_wgs=3;w3p:compute_wgs=3,persistent=1"
fi
