# session ai call 1: cold mixes, runtime.compile_gc deferred (D) against python (P), alternating
source scratch/setup.sh 2>/dev/null
T0=$(date +%s)
R=/tmp/resAI1_$T0; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt; python3 -V >> $R/gpu.txt; cat $R/gpu.txt
R50="model=resnet50 data=synthetic data.num_classes=1000 variants=imagenet variants.train_size=4096 variants.val_size=512 amp=true"
MIX="variants.train_size=5224 variants.val_size=1104 variants.lowres_epochs=1 bench.cold=true bench.epoch_mix=true bench.modes=[] bench.epoch_mix_modes=[tr]"
run_mix() {  # name, extra overrides
  local name=$1; shift
  local left=$(( 590 - ($(date +%s)-T0) ))
  if [ $left -lt 80 ]; then echo "== $name skipped"; return; fi
  (exec python3 -m tr_hydra.cli.bench $R50 $MIX "$@" bench.out=$R/${name}.json > $R/${name}.txt 2>&1) &
  local pid=$!; ( sleep $left; kill -TERM $pid 2>/dev/null ) & local k=$!
  local s=$(date +%s); wait $pid; local rc=$?; kill $k 2>/dev/null
  echo "== $name rc=$rc wall $(( $(date +%s)-s ))s at $(( $(date +%s)-T0 ))s"; grep -E "first step of every|rror" $R/${name}.txt | tail -1 | cut -c1-200; grep -oE "Python's collector [^;)]*" $R/${name}.txt | tail -7 | tr '\n' '|'; echo
}
run_mix D1 runtime.compile_gc=deferred
run_mix P1 runtime.compile_gc=python
run_mix D2 runtime.compile_gc=deferred
run_mix P2 runtime.compile_gc=python
run_mix D3 runtime.compile_gc=deferred
run_mix P3 runtime.compile_gc=python
tar czf $OUT/res.tgz -C $R .
echo "== done $(( $(date +%s)-T0 ))s"
