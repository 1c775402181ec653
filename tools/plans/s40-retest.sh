# s40's last call (about 50 s): the gpu tests that failed at e1d702e on an
# H100 for reasons of the tests (a jit-cached trace left the chain spy
# empty; an out-of-memory reference beside three workers), after c054f88.
test_stage retest 90 tests/test_mosaic_gpu.py -k "(test_gpu_h100_three_consumers and (False-8192-1024 or False-8250-2000)) or test_gpu_long_persistent_causal_items"
