# session ag call 2: one more cold pair (auto, first); a sweep through tr-train -m; GPU test files
source scratch/setup.sh 2>/dev/null
T0=$(date +%s)
R=/tmp/resAG2; rm -rf $R; mkdir -p $R
R50="model=resnet50 data=synthetic data.num_classes=1000 variants=imagenet variants.train_size=4096 variants.val_size=512 amp=true"
MIX="variants.train_size=5224 variants.val_size=1104 variants.lowres_epochs=1 bench.cold=true bench.epoch_mix=true bench.modes=[] bench.epoch_mix_modes=[tr]"
run_mix() {  # name, extra overrides
  local name=$1; shift
  local left=$(( 585 - ($(date +%s)-T0) ))
  if [ $left -lt 70 ]; then echo "== $name skipped"; return; fi
  (exec python3 -m tr_hydra.cli.bench $R50 $MIX "$@" bench.out=$R/${name}.json > $R/${name}.txt 2>&1) &
  local pid=$!; ( sleep $left; kill -TERM $pid 2>/dev/null ) & local k=$!
  local s=$(date +%s); wait $pid; local rc=$?; kill $k 2>/dev/null
  echo "== $name rc=$rc wall $(( $(date +%s)-s ))s at $(( $(date +%s)-T0 ))s"; grep -E "first step of every" $R/${name}.txt | tail -1 | cut -c1-300
}
run_mix cold_auto3 runtime.precompile_own=auto
run_mix cold_first3 runtime.precompile_own=first
# a sweep through the CLI: job 0 compiles (cold caches), job 1 (another learning rate) loads what job 0 kept
s=$(date +%s)
TORCHINDUCTOR_CACHE_DIR=/tmp/ic_sweep TRITON_CACHE_DIR=/tmp/tc_sweep timeout 200 python3 -m tr_hydra.cli.train -m \
  model=resnet50 data=synthetic data.num_classes=1000 variants=imagenet variants.train_size=5224 variants.val_size=1104 \
  variants.lowres_epochs=1 amp=true trainer.epochs=2 optimizer.lr=0.1,0.2 hydra.sweep.dir=$R/sweep > $R/sweep.txt 2>&1
echo "== sweep rc=$? wall $(( $(date +%s)-s ))s at $(( $(date +%s)-T0 ))s"
grep -E "compiling|kept|loaded|captured|first step|sweep summary|^ +[0-9] " $R/sweep.txt | cut -c1-250 | tail -20
find $R/sweep -name "*.tfevents*" -o -name "*.pt" | xargs rm -f 2>/dev/null
for f in triton maxpool inductor_compat autotune_flush; do
  left=$(( 585 - ($(date +%s)-T0) ))
  if [ $left -lt 40 ]; then echo "== $f skipped"; continue; fi
  timeout $left python3 -m pytest -q tests/gpu/test_cuda_$f.py > $R/gpu_$f.txt 2>&1
  echo "== gpu $f rc=$? at $(( $(date +%s)-T0 ))s: $(tail -1 $R/gpu_$f.txt)"
done
tar czf $OUT/res.tgz -C $R .
echo "== done $(( $(date +%s)-T0 ))s"
