# s41: split_tail with one workspace row block per program (about 280 s):
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s41-st.sh
# (XDIST=4 on an H100.)  Its gpu tests (the semaphores run only on a
# GPU), then s40's short non-causal calls with and without it (st), to
# compare the paired ratio with s40's (ptxas now reports 12/28 bytes of
# spill stores/loads at head_dim 64, outside the tile loops, 0 before).
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
test_stage st-tests 150 tests/test_mosaic_gpu.py -k "test_gpu_split_tail"
bench_stage st-short 110 --impls $I --mode fwd --head-dims 64,128 \
  --seqs 1024,2048 --causal off --samples 9 --mosaic-variants "st:split_tail=1"
