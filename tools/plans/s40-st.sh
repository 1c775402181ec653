# s40: split_tail with the merge in the kernel (about 330 s):
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s40-st.sh
# (XDIST=4 on an H100.)  Its gpu tests (the semaphores run only on a
# GPU), then the non-causal calls whose default grid is persistent
# (head_dim 64 to 2048 keys, 128 at 2048, 256 at 1024) with split_tail
# (st), and longer head_dim 128/256 calls on the persistent grid with
# and without it (p, pst; at head_dim 128 from 8192 keys in the
# 128-key form, k128p/k128pst: the 176-key form's persistent grid does
# not fit shared memory with the Q prefetch).
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
test_stage st-tests 150 tests/test_mosaic_gpu.py -k "test_gpu_split_tail"
bench_stage st-short 110 --impls $I --mode fwd --head-dims 64,128 \
  --seqs 1024,2048 --causal off --samples 9 --mosaic-variants "st:split_tail=1"
bench_stage st-d256 50 --impls $I --mode fwd --head-dims 256 \
  --seqs 1024 --causal off --samples 9 --mosaic-variants "st:split_tail=1"
K128="block_kv=128,intra_wg_overlap=1,consumer_registers=240"
K128="$K128,lean_epilogue=1,early_q_release=1,persistent=1"
bench_stage st-long 150 --impls $I --mode fwd --head-dims 128 \
  --seqs 4096,8192 --causal off --samples 9 \
  --mosaic-variants "p:persistent=1;pst:persistent=1,split_tail=1;k128p:$K128;k128pst:$K128,split_tail=1"
