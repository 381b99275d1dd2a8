# session ae call 1: GPU test of runtime.saved_store, then a cold mix and warm mixes in one cache directory
source scratch/setup.sh 2>/dev/null
T0=$(date +%s)
R=/tmp/res1; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_runtime.py -k "loaded_whole" > $R/gputest.txt 2>&1; echo "== gputest rc=$? $(( $(date +%s)-T0 ))s"; tail -3 $R/gputest.txt
R50="model=resnet50 data=synthetic data.num_classes=1000 variants=imagenet variants.train_size=4096 variants.val_size=512 amp=true"
MIX="variants.train_size=5224 variants.val_size=1104 variants.lowres_epochs=1 bench.cold=false bench.epoch_mix=true bench.modes=[] bench.epoch_mix_modes=[tr]"
run_mix() {  # name, cache-dir tag, extra overrides
  local name=$1; local tag=$2; shift; shift
  local left=$(( 570 - ($(date +%s)-T0) ))
  if [ $left -lt 60 ]; then echo "== $name skipped"; return; fi
  TORCHINDUCTOR_CACHE_DIR=/tmp/ic_$tag TRITON_CACHE_DIR=/tmp/tc_$tag python3 -m tr_hydra.cli.bench $R50 $MIX "$@" bench.out=$R/${name}.json > $R/${name}.txt 2>&1 &
  local pid=$!; ( sleep $left; kill -9 $pid 2>/dev/null ) & local k=$!
  local s=$(date +%s); wait $pid; local rc=$?; kill $k 2>/dev/null
  echo "== $name rc=$rc wall $(( $(date +%s)-s ))s at $(( $(date +%s)-T0 ))s"; grep -E "first step of every|^tr  |saved|rror|compiling" $R/${name}.txt | tail -6 | cut -c1-420
}
run_mix cold_a a
run_mix warm_store_a a
run_mix warm_nostore_a a runtime.saved_store=false
run_mix warm_dynamo_a a runtime.precompile_saved=false
run_mix warm_store2_a a
ls -la /tmp/ic_a/tr_hydra_saved > $R/store_ls.txt 2>&1
run_mix cold_off_b b runtime.precompile_saved=false
run_mix cold_c c
tar czf $OUT/res.tgz -C $R .
echo "== done $(( $(date +%s)-T0 ))s"
