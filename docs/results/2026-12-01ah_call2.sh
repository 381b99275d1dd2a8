# session ah call 2: cold mixes with the early launcher fixed: late (L) / early (E) / validation (V, early)
source scratch/setup.sh 2>/dev/null
T0=$(date +%s)
R=/tmp/resAH2_$T0; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt; ls /dev/nvidia* >> $R/gpu.txt 2>&1; cat $R/gpu.txt
R50="model=resnet50 data=synthetic data.num_classes=1000 variants=imagenet variants.train_size=4096 variants.val_size=512 amp=true"
MIX="variants.train_size=5224 variants.val_size=1104 variants.lowres_epochs=1 bench.cold=true bench.epoch_mix=true bench.modes=[] bench.epoch_mix_modes=[tr]"
run_mix() {  # name, early(on|off), extra overrides
  local name=$1; local early=$2; shift; shift
  local left=$(( 590 - ($(date +%s)-T0) ))
  if [ $left -lt 75 ]; then echo "== $name skipped"; return; fi
  (export TR_HYDRA_EARLY_LAUNCHER=$early; exec python3 -m tr_hydra.cli.bench $R50 $MIX "$@" bench.out=$R/${name}.json > $R/${name}.txt 2>&1) &
  local pid=$!; ( sleep $left; kill -TERM $pid 2>/dev/null ) & local k=$!
  local s=$(date +%s); wait $pid; local rc=$?; kill $k 2>/dev/null
  echo "== $name rc=$rc wall $(( $(date +%s)-s ))s at $(( $(date +%s)-T0 ))s"; grep -E "first step of every|rror" $R/${name}.txt | tail -1 | cut -c1-250; grep -oE "launcher could fork[^)]*\)|train_base [0-9.]+s \(start [0-9.]+s" $R/${name}.txt | tail -2
}
run_mix E1 auto
run_mix L1 off
run_mix V1 auto runtime.precompile_own=validation
run_mix V2 auto runtime.precompile_own=validation
run_mix L2 off
run_mix E2 auto
run_mix V3 auto runtime.precompile_own=validation
tar czf $OUT/res.tgz -C $R .
echo "== done $(( $(date +%s)-T0 ))s"
