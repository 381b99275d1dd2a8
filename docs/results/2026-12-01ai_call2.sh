# session ai call 2: one compile alone, compile_gc python (P) against deferred (D), alternating; then GPU tests
source scratch/setup.sh 2>/dev/null
T0=$(date +%s)
R=/tmp/resAI2_$T0; rm -rf $R; mkdir -p $R
for i in 1 2 3; do
  for mode in python deferred; do
    left=$(( 330 - ($(date +%s)-T0) )); [ $left -lt 60 ] && break
    timeout $left python3 scratch/gc/gc_probe_cuda.py $mode 2>$R/probe_${mode}_$i.err | tee -a $R/probe.jsonl
  done
done
echo "== probes done $(( $(date +%s)-T0 ))s"
left=$(( 585 - ($(date +%s)-T0) ))
timeout $left python3 -m pytest -q -x tests/gpu/test_cuda_runtime.py -k "loaded_whole and auto" tests/gpu/test_cuda_triton.py 2>&1 | tail -5 | tee $R/gputest.txt
tar czf $OUT/res.tgz -C $R .
echo "== done $(( $(date +%s)-T0 ))s"
