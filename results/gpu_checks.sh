#!/usr/bin/env bash
# The GPU measurements, each stage under a deadline: Figure 3's
# claim, the largest batches in 80 GB, the memory/time frontier, the cost models' plans and the compile peer's
# ratios on cuda, a profile of eager recomputation, and the gpu tests. Run from the repository root there,
# `bash results/gpu_checks.sh [STAGE...]`, with the
# wheels of hydra-core, omegaconf, antlr4-python3-runtime and segmentation-models-pytorch in .whl/ (configs/README.md, "A
# GPU node that reaches no package registry"). The stages, in this order (all of them when none is named):
#   profile    where eager recomputation's time goes (harness.bench.profile_step): ResNet-152 at batch 128,
#              approx_dp (tc) at 6.0 GB (with its Chrome trace, gzipped), chen_sqrt and vanilla, eager (on the
#              H200 host-bound: the GPU busy 49%, 53% once the executor's host work per recomputed layer was cut).
#   figure3    Figure 3's claim: vanilla up to the first batch that does not fit 11.4 GB, then approx_dp (tc)
#              and chen_sqrt at twice vanilla's largest batch (ResNet-152, PSPNet; F3_NETS=resnet152 for one;
#              F3_S seconds, 150 by default: on an H200 ResNet-152's five cells took 112 s), 15 timed steps a
#              point (5 left IQRs of 7-26% on the H200, where 15 gave the eager stage's vanilla 0.2%).
#   max_batch  the largest batch in 80 GB of chen_sqrt and approx_dp (tc, mc) on ResNet-50 and ResNet-152, each
#              search starting from meta's answer (results/rows_max_batch_meta), its probes memory-only.
#   eager      ResNet-152 at batch 128, eager, 15 timed steps: vanilla, approx_dp (tc) at 6.0 GB,
#              torch_checkpoint_blocks and chen_sqrt: the executor's time against PyTorch's own recomputation,
#              each beside its GPU kernel time (EAGER_S seconds, 150 by default).
#   compiled   ResNet-152 at batch 128, compiled, 15 timed steps: vanilla and approx_dp (tc) at 8.6 and 12.8 GB
#              (COMPILED_S seconds, 540 by default, a call of its own: on the H200 compiled vanilla's cell took
#              105-124 s, 80-90 s of it the compile, and approx_dp's at 8.6 GB 380 s, compiled twice: a plan that
#              holds more compiled than run eager is solved again for that much less and compiled again).
#   frontier   ResNet-152 at batch 128: vanilla eager and compiled, approx_dp (tc) eager and compiled at 6.0,
#              8.6 and 12.8 GB (the frontier's goals; DP_BUDGETS=6.0GB for fewer).
#   cost       what a cost model of measured layer times changes (harness.bench.cost_models): ResNet-152 at batch
#              128, approx_dp (tc) at 3 budgets under the paper's, the FLOPs' and the measured costs, eager.
#   peer       the compile peer's ratios on ResNet-152 at batch 128 (RATIOS, default 0.5,0.2,0,0.8,1; PEER_S
#              seconds, 460 by default), 15 timed steps, in the compiled stage's table beside its points.
#   tests      the tests marked gpu (GPU_TESTS: which files or tests).
# Each stage has a deadline; every cell writes its row as it ends and a later run resumes from the rows there,
# so a stage cut short keeps what it measured. Everything lands in $OUT/gpu_checks.tgz (rows, tables, profiles,
# tarred after each stage) and $OUT/gpu_checks.log; draw the tables again here from the rows (`--from-rows`).
# On an H200 the rows of results/rows_h200 are copied in first, so a cell measured there is not run again
# (run_cell's resume) and a run goes on where the last one stopped; EAGER_AGAIN=1 leaves out the eager
# rows among them but max_batch's (memory only), so that the stages time those again (after a change to the
# executor's host work); COMPILED_AGAIN=1 leaves out the compiled rows of time/, so that the compiled stage
# compiles vanilla in the same run as the plans it is the ratio's base for. On an H100 only Figure 3's vanilla line
# is copied in (from results/rows_h100/time/figure3).
# DEVICE=meta rehearses it here (the same commands on meta; the gpu tests skip; no profile).
set -u
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-/tmp/gpu_checks-out}
WORK=/tmp/gpu_checks
ROWS=$WORK/rows
mkdir -p "$OUT" "$ROWS"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PWD:/tmp/site
fi
exec > >(tee "$OUT/gpu_checks.log") 2>&1
# The node's copy of .git is stale: the rows are told the commit the tree was sent at, written before the tree is sent:
#   git status --porcelain --untracked-files=no | grep -q . && D=' dirty'; echo "$(git rev-parse HEAD)$D" > .whl/COMMIT
if [ -f .whl/COMMIT ]; then
    export HARNESS_GIT_COMMIT=$(cat .whl/COMMIT)
fi

stage() {  # stage SECONDS COMMAND...: run it under a deadline, then end what its cells left running
    local seconds=$1
    shift
    echo "=== $(date -u +%T) stage ($seconds s): $*"
    timeout -k 5 "$seconds" bash -c "$*"
    echo "=== $(date -u +%T) stage ended: exit $?"
    pkill -9 -f spawn_main 2> /dev/null
    sleep 1
    tar czf "$OUT/gpu_checks.tgz" -C "$WORK" .  # after each stage: a run cut short still returns its rows
}

nvidia-smi -L
CARD=$(python3 -c "import torch; print(torch.cuda.is_available() and torch.cuda.get_device_name())")
echo "torch $(python3 -c 'import torch; print(torch.__version__)') on $CARD"
if [ "$DEVICE" = cuda ] && [ "$CARD" = "NVIDIA H200" ]; then
    cp -r results/rows_h200/. "$ROWS/"
    if [ "${EAGER_AGAIN:-0}" = 1 ]; then
        # the compiled rows end in __cuda__compiled.json; max_batch's probes time nothing (--timed-steps 0)
        find "$ROWS" -path "$ROWS/max_batch" -prune -o -name '*__cuda.json' -print0 | xargs -0 rm -f
    fi
    if [ "${COMPILED_AGAIN:-0}" = 1 ]; then  # compiled vanilla timed again, in the same run as the plans
        rm -f "$ROWS"/time/*__cuda__compiled.json
    fi
elif [ "$DEVICE" = cuda ] && [ "$CARD" = "NVIDIA H100 80GB HBM3" ]; then
    # Figure 3's vanilla line on this card (the batches its plans are read against); the plans are timed again
    mkdir -p "$ROWS/figure3"
    cp results/rows_h100/time/figure3/*__vanilla__* "$ROWS/figure3/"
fi
STAGES=${*:-profile figure3 max_batch frontier cost peer tests}
FR="python3 -m harness.bench.frontier --device $DEVICE --nets resnet152 --timed-steps 10 --rows $ROWS/frontier"
FR15="python3 -m harness.bench.frontier --device $DEVICE --nets resnet152 --timed-steps 15 --rows $ROWS/time"
for name in $STAGES; do
    case $name in
    profile)
        [ "$DEVICE" = cuda ] || continue
        PS="python3 -m harness.bench.profile_step --device cuda --batch 128 --steps 3 --top 40"
        stage 120 "$PS $WORK/profile_tc6 resnet152 approx_dp --budget 6GB --trace && gzip -f $WORK/profile_tc6.json \
            && $PS $WORK/profile_chen resnet152 chen_sqrt && $PS $WORK/profile_vanilla resnet152 vanilla" ;;
    figure3)
        F3="python3 -m harness.bench.figure3 --device $DEVICE --memory 11.4GB --timed-steps 15 --rows $ROWS/figure3"
        PSP="$F3 $WORK/f3c --nets pspnet --curves vanilla --batches 1,2,3 \
            && $F3 $WORK/f3d --nets pspnet --curves 'approx_dp (tc),chen_sqrt' --batches 4"
        case ${F3_NETS:-resnet152,pspnet} in *pspnet*) ;; *) PSP=true ;; esac
        stage "${F3_S:-150}" "$F3 $WORK/f3a --nets resnet152 --curves vanilla --batches 32,48,64 \
            && $F3 $WORK/f3b --nets resnet152 --curves 'approx_dp (tc),chen_sqrt' --batches 96 && $PSP" ;;
    eager)
        stage "${EAGER_S:-150}" "$FR15 $WORK/time_eager --strategies approx_dp,torch_checkpoint_blocks,chen_sqrt \
            --dp-budgets 6.0GB --modes eager" ;;
    compiled)  # vanilla first: the plans' ratios are to it, in the same run
        stage "${COMPILED_S:-540}" "$FR15 $WORK/time_compiled --strategies vanilla --modes compiled \
            && $FR15 $WORK/time_compiled --strategies approx_dp --dp-budgets 8.6GB,12.8GB --modes compiled" ;;
    max_batch)
        stage "${MAX_BATCH_S:-300}" "python3 -m harness.bench.max_batch $WORK/max_batch --device $DEVICE --memory 80GB \
            --nets resnet50,resnet152 --strategies chen_sqrt,approx_dp --guess-from results/rows_max_batch_meta \
            --timed-steps 0 --rows $ROWS/max_batch" ;;
    frontier)
        stage 240 "$FR $WORK/fra --strategies approx_dp --dp-budgets ${DP_BUDGETS:-6.0GB,8.6GB,12.8GB}" ;;
    cost)
        stage 200 "python3 -m harness.bench.cost_models $WORK/cost_models_cuda --device cuda --points 3 \
            --rows $ROWS/cost_models" ;;
    peer)  # beside the compiled stage's points (its rows resumed), for the domination lines
        stage "${PEER_S:-460}" "$FR15 $WORK/time_compiled --strategies approx_dp,torch_compile_budget \
            --dp-budgets 8.6GB,12.8GB --modes compiled --ratios ${RATIOS:-0.5,0.2,0,0.8,1}" ;;
    tests)
        stage 130 "python3 -m pytest -q -p no:cacheprovider -m gpu \
            ${GPU_TESTS:-tests/test_measure.py tests/test_swap.py tests/test_gpu.py}" ;;
    *)
        echo "unknown stage $name; valid: profile figure3 eager compiled max_batch frontier cost peer tests"
        exit 2 ;;
    esac
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
echo "=== $(date -u +%T) done"
