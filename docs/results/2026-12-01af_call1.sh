# session af call 1: the first cuDNN search split over k threads (fresh process each); then warm mixes with 1 and several ahead threads
source scratch/setup.sh 2>/dev/null
T0=$(date +%s)
R=/tmp/res1; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
for k in 1 1 4 8 2 0 16; do
  left=$(( 300 - ($(date +%s)-T0) )); [ $left -lt 30 ] && break
  timeout $left python3 scratch/cudnn_par.py $k >> $R/par.txt 2>>$R/par_err.txt; tail -1 $R/par.txt
done
R50="model=resnet50 data=synthetic data.num_classes=1000 variants=imagenet variants.train_size=4096 variants.val_size=512 amp=true"
MIX="variants.train_size=5224 variants.val_size=1104 variants.lowres_epochs=1 bench.cold=false bench.epoch_mix=true bench.modes=[] bench.epoch_mix_modes=[tr]"
run_mix() {  # name, threads, extra overrides
  local name=$1; local th=$2; shift; shift
  local left=$(( 575 - ($(date +%s)-T0) ))
  if [ $left -lt 50 ]; then echo "== $name skipped"; return; fi
  TR_HYDRA_CUDNN_AHEAD_THREADS=$th TORCHINDUCTOR_CACHE_DIR=/tmp/ic_c TRITON_CACHE_DIR=/tmp/tc_c python3 -m tr_hydra.cli.bench $R50 $MIX "$@" bench.out=$R/${name}.json > $R/${name}.txt 2>&1 &
  local pid=$!; ( sleep $left; kill -9 $pid 2>/dev/null ) & local k=$!
  local s=$(date +%s); wait $pid; local rc=$?; kill $k 2>/dev/null
  echo "== $name rc=$rc wall $(( $(date +%s)-s ))s at $(( $(date +%s)-T0 ))s"; grep -E "first step of every|^tr  |prime_cudnn|rror" $R/${name}.txt | tail -4 | cut -c1-300
}
run_mix cold_c 1
run_mix warm_t1_a 1
run_mix warm_t8_a 8
run_mix warm_t1_b 1
run_mix warm_t8_b 8
tar czf $OUT/res.tgz -C $R .
echo "== done $(( $(date +%s)-T0 ))s"
