# The next H100 call (docs/perf-notes.md, "Next (thirty-fifth session's
# view)" item 2), about 520 s of device time:
#   bash tools/gpu_session.sh stages tools/plans/s36-h100.sh
# (kind nvidia-h100-x1, carry .whl; JAXFLASH_COMMIT=<commit>).  Since s35
# the H100 SXM's default is the H200 entry (tuning.json aliases): first
# its default-path gpu tests, then forward+backward against the untuned
# entry (--tuned-for default: the variant "dflt" is what it ran before).
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
test_stage default-path 270 tests/test_mosaic_gpu.py \
  tests/test_mask_features.py tests/test_api.py tests/test_numerics.py \
  -k "(test_gpu_long or (test_gpu and default) or segments_and_lengths or masks_gpu or deterministic or persistent-pairs) and not triton"
bench_stage fwdbwd 220 --impls $I --mode fwd_bwd --tuned-for default \
  --head-dims 64,128,256 --seqs 2048,8192 --causal both --samples 5 \
  --mosaic-variants "dflt:stages=2"
