# session ah call 3: GPU test loaded_whole (auto, first); tr-train cold through the CLI, launcher early / late
source scratch/setup.sh 2>/dev/null
T0=$(date +%s)
R=/tmp/resAH3_$T0; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
train_cold() {  # name, early(auto|off)
  local name=$1; local early=$2
  local left=$(( 560 - ($(date +%s)-T0) ))
  if [ $left -lt 90 ]; then echo "== $name skipped"; return; fi
  local s=$(date +%s.%N)
  TR_HYDRA_EARLY_LAUNCHER=$early TORCHINDUCTOR_CACHE_DIR=$R/ic_$name TRITON_CACHE_DIR=$R/tc_$name timeout $left \
    python3 -m tr_hydra.cli.train model=resnet50 data=synthetic data.num_classes=1000 variants=imagenet \
    variants.train_size=5224 variants.val_size=1104 variants.lowres_epochs=1 amp=true trainer.epochs=1 \
    hydra.run.dir=$R/run_$name 2>&1 | awk -v s=$s '{ c="date +%s.%N"; c | getline t; close(c); printf "%7.2f %s\n", t-s, $0; fflush() }' > $R/train_$name.txt
  echo "== $name at $(( $(date +%s)-T0 ))s"; grep -E "compiling 6|captured|epoch +1|rror" $R/train_$name.txt | cut -c1-220
  rm -rf $R/ic_$name $R/tc_$name; find $R/run_$name -name "*.pt" -delete
}
train_cold late1 off
train_cold early1 auto
timeout 200 python3 -m pytest -q -x tests/gpu/test_cuda_runtime.py -k "loaded_whole and (auto or first)" > $R/gputest_loaded_whole.txt 2>&1
echo "== gputest rc=$? at $(( $(date +%s)-T0 ))s"; tail -2 $R/gputest_loaded_whole.txt
train_cold early2 auto
train_cold late2 off
tar czf $OUT/res.tgz -C $R --exclude='ic_*' --exclude='tc_*' .
echo "== done $(( $(date +%s)-T0 ))s"
