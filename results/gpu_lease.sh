#!/usr/bin/env bash
# The GPU checks of issues 15 and 16 that fit one short lease of the device machine (15 minutes of device
# time, start included): run from the repository root there, `bash results/gpu_lease.sh`, with the wheels
# of hydra-core, omegaconf, antlr4-python3-runtime and segmentation-models-pytorch in .whl/ (README, "A GPU
# node that reaches no package registry"). Each stage has a deadline; every cell writes its row as it ends
# and a later run resumes from the rows there, so a stage cut short keeps what it measured. Everything lands
# in $OUT/lease.tgz (rows and tables) and $OUT/lease.log; the tables are drawn again here from the rows
# (`--from-rows`).
#   0. Where eager recomputation's time goes (harness.bench.profile_step): ResNet-152 at batch 128, vanilla
#      and approx_dp (tc) at 6.0 GB, eager (on the H200, 137 and 305 ms for 1.20x the FLOPs).
#   1. Figure 3's claim: vanilla up to the first batch that does not fit 11.4 GB, then approx_dp (tc) and
#      chen_sqrt at twice vanilla's largest batch (ResNet-152, PSPNet).
#   2. The frontier on ResNet-152 at batch 128: vanilla eager and compiled, approx_dp (tc) eager and compiled
#      at 6.0 GB (issue 16's first goal), the compile peer at ratio 0.2; then, as time allows, more budgets
#      and ratios.
#   3. The tests marked gpu.
# On an H200 the rows of results/rows_h200 are copied in first, so a cell measured there is not run again
# (run_cell's resume) and the lease goes on where the last one stopped.
# DEVICE=meta rehearses it here (the same commands on meta; the gpu tests skip; no profile).
set -u
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-/tmp/lease-out}
WORK=/tmp/lease
ROWS=$WORK/rows
mkdir -p "$OUT" "$ROWS"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PWD:/tmp/site
fi
exec > >(tee "$OUT/lease.log") 2>&1

stage() {  # stage SECONDS COMMAND...: run it under a deadline, then end what its cells left running
    local seconds=$1
    shift
    echo "=== $(date -u +%T) stage ($seconds s): $*"
    timeout -k 5 "$seconds" bash -c "$*"
    echo "=== $(date -u +%T) stage ended: exit $?"
    pkill -9 -f spawn_main 2> /dev/null
    sleep 1
    tar czf "$OUT/lease.tgz" -C "$WORK" .  # after each stage: a lease cut short still returns its rows
}

nvidia-smi -L
CARD=$(python3 -c "import torch; print(torch.cuda.is_available() and torch.cuda.get_device_name())")
echo "torch $(python3 -c 'import torch; print(torch.__version__)') on $CARD"
if [ "$DEVICE" = cuda ] && [ "$CARD" = "NVIDIA H200" ]; then
    cp -r results/rows_h200/. "$ROWS/"
fi
if [ "$DEVICE" = cuda ]; then
    PS="python3 -m harness.bench.profile_step --device cuda --batch 128 --steps 3"
    stage 80 "$PS $WORK/profile_vanilla resnet152 vanilla && $PS $WORK/profile_tc6 resnet152 approx_dp --budget 6GB"
fi
F3="python3 -m harness.bench.figure3 --device $DEVICE --memory 11.4GB --rows $ROWS/figure3"
stage 110 "$F3 $WORK/f3a --nets resnet152 --curves vanilla --batches 32,48,64 \
    && $F3 $WORK/f3b --nets resnet152 --curves 'approx_dp (tc),chen_sqrt' --batches 96 \
    && $F3 $WORK/f3c --nets pspnet --curves vanilla --batches 1,2,3 \
    && $F3 $WORK/f3d --nets pspnet --curves 'approx_dp (tc),chen_sqrt' --batches 4"
FR="python3 -m harness.bench.frontier --device $DEVICE --nets resnet152 --timed-steps 10 --rows $ROWS/frontier"
stage 240 "$FR $WORK/fra --strategies approx_dp,torch_compile_budget --ratios 0.2 --dp-budgets 6.0GB \
    && $FR $WORK/frb --strategies approx_dp,torch_compile_budget --ratios 0.2,0.5,1 --dp-budgets 6.0GB,8.6GB,12.8GB"
stage 130 "python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_measure.py tests/test_swap.py tests/test_gpu.py"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
echo "=== $(date -u +%T) done"
