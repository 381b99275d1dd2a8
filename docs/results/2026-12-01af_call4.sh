# session af call 2: GPU test of the kept first variant; cold mix; then warm mixes alternating
# the new code (all six kept, loaded during cuDNN's search) with ec2c89b's (five kept)
source scratch/setup.sh 2>/dev/null
T0=$(date +%s)
R=/tmp/res2; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
echo skip-gputest
R50="model=resnet50 data=synthetic data.num_classes=1000 variants=imagenet variants.train_size=4096 variants.val_size=512 amp=true"
MIX="variants.train_size=5224 variants.val_size=1104 variants.lowres_epochs=1 bench.cold=false bench.epoch_mix=true bench.modes=[] bench.epoch_mix_modes=[tr]"
run_mix() {  # name, code (new|old), extra overrides
  local name=$1; local code=$2; shift; shift
  local left=$(( 490 - ($(date +%s)-T0) ))
  if [ $left -lt 50 ]; then echo "== $name skipped"; return; fi
  local dir=$PWD; [ $code = old ] && dir=$PWD/scratch/old
  (cd $dir && PYTHONPATH=/tmp/site:$dir TORCHINDUCTOR_CACHE_DIR=/tmp/ic_c TRITON_CACHE_DIR=/tmp/tc_c exec python3 -m tr_hydra.cli.bench $R50 $MIX "$@" bench.out=$R/${name}.json > $R/${name}.txt 2>&1) &
  local pid=$!; ( sleep $left; kill -9 $pid 2>/dev/null ) & local k=$!
  local s=$(date +%s); wait $pid; local rc=$?; kill $k 2>/dev/null
  echo "== $name rc=$rc wall $(( $(date +%s)-s ))s at $(( $(date +%s)-T0 ))s"; grep -E "first step of every|^tr  |loaded|rror" $R/${name}.txt | tail -4 | cut -c1-300
}
(cd scratch/old && PYTHONPATH=/tmp/site:$PWD python3 -c "import tr_hydra, os; print('old code from', os.path.dirname(tr_hydra.__file__))")
run_mix warm_new0 new
run_mix fill_old old
run_mix warm_new1 new
run_mix warm_old1 old
run_mix warm_new2 new
run_mix warm_old2 old
run_mix warm_new3 new
run_mix warm_old3 old
ls -la /tmp/ic_c/tr_hydra_saved > $R/store_ls.txt
left=$(( 575 - ($(date +%s)-T0) ))
echo end
tar czf $OUT/res.tgz -C $R .
echo "== done $(( $(date +%s)-T0 ))s"
