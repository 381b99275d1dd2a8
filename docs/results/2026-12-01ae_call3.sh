# session ae call 3: the GPU suites on the final code
source scratch/setup.sh 2>/dev/null
T0=$(date +%s)
R=/tmp/res3; mkdir -p $R
for f in test_cuda_runtime test_cuda_prime test_cuda_maxpool test_cuda_triton test_cuda_inductor_compat test_cuda_backward_streams test_cuda_autotune_flush test_cuda_input test_cuda_ddp; do
  left=$(( 540 - ($(date +%s)-T0) ))
  if [ $left -lt 30 ]; then echo "$f skipped (time)"; continue; fi
  s=$(date +%s)
  timeout $left python3 -m pytest -p no:cacheprovider --show-capture=no -rfs -q tests/gpu/$f.py > $R/$f.txt 2>&1
  echo "$f rc=$? $(( $(date +%s)-s ))s: $(tail -1 $R/$f.txt)"
done
tar czf $OUT/res.tgz -C $R .
