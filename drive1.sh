set -u
export JAXFLASH_COMMIT=c3dd817
bash tools/gpu_session.sh none >/dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD/.whl/stub:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s)
timeout 170 python3 -m pytest -m gpu tests/test_mosaic_gpu.py -k "test_gpu and (named-persistent or named-split or split-kv or named-row-sum)" -p no:cacheprovider -p no:benchmark -n 8 -q -rfE > $OUT/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; tail -3 $OUT/tests.log
B="python3 -m jaxflash.bench --impls jaxflash-mosaic_gpu,cudnn,tokamax-mosaic"
timeout 200 $B --head-dims 256 --seqs 4096,8192,16384 --mode fwd --mosaic-variants "sk:split_kv_release=1;rs:row_sum_in_pv=1;skrs:split_kv_release=1,row_sum_in_pv=1" --out $OUT --name fwd256 2> $OUT/b1.err | tail -40
echo "b1 $(( $(date +%s)-T0 ))s"
timeout 110 $B --head-dims 64,128 --seqs 4096,16384 --mode fwd --mosaic-variants "sk:split_kv_release=1" --out $OUT --name fwd64128 2> $OUT/b2.err | tail -36
echo "b2 $(( $(date +%s)-T0 ))s"
REM=$(( 540 - ($(date +%s)-T0) ))
timeout $REM $B --head-dims 256 --seqs 2048,4096,8192,16384 --mode fwd_bwd --out $OUT --name fb256 2> $OUT/b3.err | tail -30
echo "b3 $(( $(date +%s)-T0 ))s"
rm -f $OUT/*.png
ls $OUT
