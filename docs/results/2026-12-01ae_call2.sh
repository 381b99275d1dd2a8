# session ae call 2: ordinary warm runs (caches from a cold run without saved compiles) against warm runs from the store, alternating
source scratch/setup.sh 2>/dev/null
T0=$(date +%s)
R=/tmp/res2; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
R50="model=resnet50 data=synthetic data.num_classes=1000 variants=imagenet variants.train_size=4096 variants.val_size=512 amp=true"
MIX="variants.train_size=5224 variants.val_size=1104 variants.lowres_epochs=1 bench.cold=false bench.epoch_mix=true bench.modes=[] bench.epoch_mix_modes=[tr]"
run_mix() {  # name, cache-dir tag, extra overrides
  local name=$1; local tag=$2; shift; shift
  local left=$(( 575 - ($(date +%s)-T0) ))
  if [ $left -lt 50 ]; then echo "== $name skipped"; return; fi
  TORCHINDUCTOR_CACHE_DIR=/tmp/ic_$tag TRITON_CACHE_DIR=/tmp/tc_$tag python3 -m tr_hydra.cli.bench $R50 $MIX "$@" bench.out=$R/${name}.json > $R/${name}.txt 2>&1 &
  local pid=$!; ( sleep $left; kill -9 $pid 2>/dev/null ) & local k=$!
  local s=$(date +%s); wait $pid; local rc=$?; kill $k 2>/dev/null
  echo "== $name rc=$rc wall $(( $(date +%s)-s ))s at $(( $(date +%s)-T0 ))s"; grep -E "first step of every|^tr  |loaded|rror" $R/${name}.txt | tail -4 | cut -c1-300
}
run_mix cold_c c
run_mix cold_off_b b runtime.precompile_saved=false
run_mix warm_off_b1 b runtime.precompile_saved=false
run_mix warm_store_c1 c
run_mix warm_off_b2 b runtime.precompile_saved=false
run_mix warm_store_c2 c
run_mix warm_off_b3 b runtime.precompile_saved=false
run_mix warm_store_c3 c
tar czf $OUT/res.tgz -C $R .
echo "== done $(( $(date +%s)-T0 ))s"
