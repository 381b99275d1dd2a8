# session ag call 1: GPU test of precompile_own (auto, first); then cold mixes alternating first/auto
source scratch/setup.sh 2>/dev/null
T0=$(date +%s)
R=/tmp/resAG3; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
R50="model=resnet50 data=synthetic data.num_classes=1000 variants=imagenet variants.train_size=4096 variants.val_size=512 amp=true"
MIX="variants.train_size=5224 variants.val_size=1104 variants.lowres_epochs=1 bench.cold=true bench.epoch_mix=true bench.modes=[] bench.epoch_mix_modes=[tr]"
run_mix() {  # name, extra overrides
  local name=$1; shift
  local left=$(( 585 - ($(date +%s)-T0) ))
  if [ $left -lt 70 ]; then echo "== $name skipped"; return; fi
  (exec python3 -m tr_hydra.cli.bench $R50 $MIX "$@" bench.out=$R/${name}.json > $R/${name}.txt 2>&1) &
  local pid=$!; ( sleep $left; kill -TERM $pid 2>/dev/null ) & local k=$!
  local s=$(date +%s); wait $pid; local rc=$?; kill $k 2>/dev/null
  echo "== $name rc=$rc wall $(( $(date +%s)-s ))s at $(( $(date +%s)-T0 ))s"; grep -E "first step of every|compiling 6|^tr  |rror" $R/${name}.txt | tail -4 | cut -c1-300
}
run_mix cold_auto4 runtime.precompile_own=auto
run_mix cold_first4 runtime.precompile_own=first
run_mix cold_first5 runtime.precompile_own=first
run_mix cold_auto5 runtime.precompile_own=auto
tar czf $OUT/res.tgz -C $R .
echo "== done $(( $(date +%s)-T0 ))s"
