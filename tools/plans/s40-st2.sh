# s40, after s40-st.sh (about 120 s): the head_dim 64 split_tail gpu test
# fixed (item_overlap off: chained items take no split), then
# split_tail where the last wave is nearly empty: the H200 entry's head_dim
# 64 non-causal form (two consumers, --tuned-for) makes 4096 items of
# 128 rows, 31 waves and 4 items over 132 SMs; split, each of those
# items goes to 16 or 17 programs of one key tile or none.  Against the
# same form without item_overlap (which takes no split) at 1024-2048 keys.
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
test_stage st-test-d64 90 tests/test_mosaic_gpu.py \
  -k "test_gpu_split_tail and 64-2048-2048"
bench_stage st-d64-h200form 100 --impls $I --mode fwd --head-dims 64 \
  --seqs 1024,2048 --causal off --samples 9 --tuned-for "NVIDIA H200" \
  --mosaic-variants "io0:item_overlap=0;st:item_overlap=0,split_tail=1"
