#!/usr/bin/env bash
# The GPU runs behind benchmarks/results/*_h200.json, as stages of one script, so a few
# device calls cover them. Run from the repository root on the GPU machine:
#
#   OUT=/some/dir OPCONTRACT_COMMIT=<commit> \
#       bash benchmarks/run_h200.sh tests memory gemm sweep-head tuned
#
# <commit> is the commit of the tree being run, written out where the command is composed:
# a copy of the working tree on another machine may carry a stale .git, so
# $(git rev-parse HEAD) evaluated there can name an older commit.
#
# Wheels for what the GPU image lacks (pydantic, optuna, tqdm, liger-kernel, pytest-xdist) are
# expected in .whl/; batch_invariant_ops (the dense_gemm peer) in .peers/ if wanted.
# Each stage has its own time limit and writes its log and JSON under $OUT.
set -uo pipefail
: "${OUT:?set OUT to the folder for results}"
if [ -z "${SKIP_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
# TREE: another checkout's root (an older commit copied into .old/, say) whose opcontract the
# stages import instead of this one's; the scripts stay this tree's. LABEL names its results.
TREE=${TREE:-$PWD}
LABEL=${LABEL:-new}
export PYTHONPATH=/tmp/site:$TREE:$PWD/.peers${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SWEEP=opcontract/tuning/sweeps/muse_glimmer.yaml
TABLE=${TABLE:-$OUT/h200.json}  # a table outside $OUT (/tmp) carries a sweep to the next call
[ -f "$TABLE" ] || cp opcontract/tables/h200.json "$TABLE"

# SM clock, temperature and throttle reasons every 5 s beside the stages (a machine that slows
# itself down for heat gives times that compare with nothing: see the summary at the end)
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,clocks_throttle_reasons.active \
        --format=csv,noheader -l 5 >> "$OUT/clocks.csv" 2>/dev/null &
    CLOCKS_PID=$!
    trap 'kill $CLOCKS_PID 2>/dev/null; python3 benchmarks/clock_summary.py "$OUT/clocks.csv"' EXIT
fi

stage() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" 2>&1 | grep -v -i "warn" | tee "$OUT/$name.log" | tail -40
    [ "$TABLE" -ef "$OUT/h200.json" ] || cp "$TABLE" "$OUT/h200.json"
}

sweep() {  # label, --only filter, trials, seconds per study, stage limit, extra options...
    local label=$1 only=$2 trials=$3 per_study=$4 limit=$5
    shift 5
    stage "sweep-$label" "${SWEEP_LIMIT:-$limit}" python3 -m opcontract.cli.tune sweep $SWEEP \
        --only "$only" --table "$TABLE" --storage "sqlite:////tmp/tune.db" --trials "$trials" \
        --timeout "$per_study" --compile-workers "${COMPILE_WORKERS:-8}" --no-progress "$@"
}

for s in "$@"; do
    case $s in
        tests)  # pytest-xdist (a wheel in .whl) compiles the kernels of several tests at once
            workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${TEST_WORKERS:-8}")
            stage "tests-$LABEL" "${TESTS_LIMIT:-420}" python3 -m pytest -q -m gpu "$TREE/tests/" \
                -p no:cacheprovider $workers ;;
        bits)  # every output and gradient's sha256, one process per op (compiles in parallel)
            for op in dense_gemm fused_add_rms_norm linear_cross_entropy normalized_embedding \
                rms_norm softcap_logprob swiglu; do
                python3 benchmarks/bits_snapshot.py --device cuda --ops "$op" \
                    --commit "${OPCONTRACT_COMMIT:-unknown}" --out "/tmp/bits_${LABEL}_$op.json" \
                    > "$OUT/bits_${LABEL}_$op.log" 2>&1 &
            done
            wait
            python3 benchmarks/bits_snapshot.py --merge /tmp/bits_"${LABEL}"_*.json \
                --out "$OUT/bits_snapshot_h200_${LABEL}.json" ;;
        conformance) stage "conformance-$LABEL" "${CONFORMANCE_LIMIT:-400}" \
            python3 -m opcontract.cli.lint --conformance --device cuda ;;
        fuzz) stage fuzz "${FUZZ_LIMIT:-300}" python3 benchmarks/fuzz_counts.py --device cuda \
            --out "$OUT/fuzz_counts_h200.json" ;;
        host-time) stage "host-time-$LABEL" 120 python3 benchmarks/host_time.py --label "$LABEL" \
            --parameters --layers --out "$OUT/host_time_h200_${LABEL}.json" ;;
        decode-syncs)  # host syncs per eager decode step and tokens/s, stock and patched (B = 1)
            stage decode-syncs 200 python3 benchmarks/decode_syncs.py --time 32 \
                --out "$OUT/decode_syncs_h200.json" ;;
        norms) stage norms 180 python3 benchmarks/norm_kernels_explore.py \
            --out "$OUT/norm_kernels_explore_h200.json" ;;
        rms-decode) stage rms-decode 120 python3 benchmarks/rms_decode_explore.py \
            --out "$OUT/rms_decode_explore_h200.json" ;;
        lm-backward) stage lm-backward 240 python3 benchmarks/lm_head_backward_explore.py \
            --out "$OUT/lm_head_backward_explore_h200.json" ;;
        memory) stage memory 300 python3 benchmarks/memory_bound_ops.py --rep-ms 100 \
            --out "$OUT/memory_bound_ops_h200.json" ;;
        gemm) stage gemm 240 python3 benchmarks/dense_gemm.py --out "$OUT/dense_gemm_h200.json" ;;
        host) stage host 90 python3 benchmarks/host_overhead.py --out "$OUT/host_overhead_h200.json" ;;
        host-profile) stage host-profile 90 python3 benchmarks/host_profile.py \
            --out "$OUT/host_profile_h200.json" --profile "$OUT/host_profile_h200.txt" ;;
        forward) stage forward 400 python3 benchmarks/softcap_logprob_forward.py \
            --out "$OUT/softcap_logprob_forward_h200.json" ;;
        train) stage train 500 python3 benchmarks/softcap_logprob_train.py \
            --out "$OUT/softcap_logprob_train_h200.json" ;;
        # trials cover each narrowed space (the sweep file's `space:`) as a grid
        sweep-head) sweep head softcap_logprob 16 60 540 ;;
        sweep-ce) sweep ce linear_cross_entropy 16 60 540 ;;
        sweep-gemm) sweep gemm dense_gemm 36 60 540 ;;
        sweep-gemm-decode) sweep gemm-decode triton.gemm 36 60 400 --max-batch 64 ;;
        sweep-cute-decode) sweep cute-decode cute.gemm 16 60 300 --max-batch 64 ;;
        sweep-cute-train) sweep cute-train cute.gemm 8 60 400 --min-batch 256 ;;
        sweep-hf-decode)  # the HF patch's separate projections at decode sizes, Triton and CuTe
            python3 benchmarks/sweep_subset.py $SWEEP --sizes N=4096,K=6656 N=256,K=6656 \
                N=19968,K=6656 --out /tmp/hf_projections.yaml
            SWEEP=/tmp/hf_projections.yaml sweep hf-decode dense_gemm 36 40 540 --max-batch 64 ;;
        sweep-swiglu) sweep swiglu swiglu 12 30 240 ;;
        sweep-sampler) sweep sampler triton.logits 12 50 300 ;;  # decode buckets: tma or apart
        sweep-cute-head) sweep cute-head cute.fused,cute.fused_ce 8 50 540 ;;
        sweep-cute-head-quick)  # the training buckets only, the default and one more candidate
            sweep cute-head-quick cute.fused,cute.fused_ce 2 45 300 --min-batch 8192 ;;
        sweep) sweep all softcap_logprob,linear_cross_entropy,swiglu,dense_gemm 36 60 540 ;;
        tuned) stage tuned "${TUNED_LIMIT:-400}" python3 benchmarks/tuned_dispatch.py $SWEEP --table "$TABLE" \
            --out "$OUT/tuned_dispatch_h200.json" ;;
        verify) stage verify "${VERIFY_LIMIT:-300}" python3 -m opcontract.cli.tune verify \
            --table "$TABLE" --device cuda ${VERIFY_ONLY:+--only "$VERIFY_ONLY"} ;;
        cute-overlap) stage cute-overlap 240 python3 benchmarks/cute_gemm_overlap_explore.py \
            --out "$OUT/cute_gemm_overlap_explore_h200.json" ;;
        attention-tests)  # the kernels compile per test: several tests at once (xdist)
            workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${TEST_WORKERS:-8}")
            stage attention-tests "${TESTS_LIMIT:-420}" python3 -m pytest -q -m gpu \
                "$TREE/tests/test_gated_attention.py" -p no:cacheprovider $workers ;;
        attention-spills)  # decode and training forward at the defaults after the spill fix
            stage attention-decode-spills 240 python3 benchmarks/attention_decode_explore.py \
                --split 1 --block-m 64 --warps 4,8 --stages 1,2 --interior 1 --B 1,8,64,256 \
                --L 8192,32768 --note "tree ${OPCONTRACT_COMMIT:-unknown}" \
                --out "$OUT/attention_decode_spills_h200.json"
            stage attention-forward-spills 200 python3 benchmarks/attention_forward_explore.py \
                --lengths 8192,16384 --note "tree ${OPCONTRACT_COMMIT:-unknown}" --configs \
                '[{"block_m":128,"num_stages":2,"interior":1}]' \
                --out "$OUT/attention_forward_spills_h200.json" ;;
        attention-options)  # the launch options off by default (interior, flat), each checked bitwise
            stage attention-forward-options 400 python3 benchmarks/attention_forward_explore.py \
                --lengths 8192,16384 --note "tree ${OPCONTRACT_COMMIT:-unknown}" --configs \
                '[{"block_m":128,"num_stages":2},{"block_m":128,"num_stages":2,"interior":1},{"block_m":128,"num_stages":2,"flat":1},{"block_m":128,"num_stages":2,"interior":1,"flat":1}]' \
                --out "$OUT/attention_forward_options_h200.json"
            stage attention-decode-options 300 python3 benchmarks/attention_decode_explore.py \
                --split 1 --block-m 64 --warps 4 --stages 1,2 --interior 0,1 --B 1,8,64 \
                --L 8192,32768 --note "tree ${OPCONTRACT_COMMIT:-unknown}" \
                --out "$OUT/attention_decode_options_h200.json" ;;
        row-sum)  # the block row sum written out (_block_sum): the earlier kernels' bits kept
            # (benchmarks/_kernels_before.py: git show REV:opcontract/backends/triton/
            # gated_attention_kernels.py), and 16-row decode tiles against them
            stage row-sum-decode 420 python3 benchmarks/attention_decode_explore.py \
                --before _kernels_before --split 1 --block-m 16,64 --warps 4 --stages 1,2 \
                --interior 1 --B "${ROW_SUM_B:-1,8,64,256}" --L 8192,32768 \
                --note "tree ${OPCONTRACT_COMMIT:-unknown}" --out "$OUT/attention_row_sum_decode_h200.json"
            stage row-sum-forward 240 python3 benchmarks/attention_forward_explore.py \
                --before _kernels_before --lengths 8192,16384 --configs '[{}]' \
                --note "tree ${OPCONTRACT_COMMIT:-unknown}" --out "$OUT/attention_row_sum_forward_h200.json" ;;
        decode-kernels)  # split decode's GPU time by kernel (chunks, merge) at the defaults' tiles
            stage decode-kernels 240 python3 benchmarks/attention_decode_explore.py --kernel-us \
                --split 1 --block-m 16 --warps 4 --stages 1,2 --interior 1 --merge-in 0,1 --B 1,8,64 \
                --L 8192,32768 --note "tree ${OPCONTRACT_COMMIT:-unknown}" \
                --out "$OUT/attention_decode_kernels_${LABEL}.json" ;;
        merge-ahead)  # split decode's read-ahead merge against the plain one
            stage merge-ahead 300 python3 benchmarks/attention_decode_explore.py --kernel-us \
                --split 1 --block-m 16 --warps 4 --stages 2 --interior 1 --merge-ahead 0,1 \
                --B 1,8,64 --L 8192,32768 --note "tree ${OPCONTRACT_COMMIT:-unknown}" \
                --out "$OUT/attention_decode_merge_ahead_${LABEL}.json" ;;
        decode-stages)  # decode's 16-row tiles: warps (1, 2: a tile's rows in fewer warps) and stages
            stage decode-stages 240 python3 benchmarks/attention_decode_explore.py --kernel-us \
                --split 1 --block-m 16 --warps 1,2,4 --stages 1,2,3 --interior 1 --merge-ahead -1 \
                --B 1,8,64 --L 8192,32768 --note "tree ${OPCONTRACT_COMMIT:-unknown}" \
                --out "$OUT/attention_decode_stages_${LABEL}.json" ;;
        rows-first)  # split decode: block rows read with each block (0), before a chunk's blocks (1), at the start (2)
            stage rows-first "${ROWS_LIMIT:-300}" python3 benchmarks/attention_decode_explore.py \
                --kernel-us --split 1 --block-m 16 --warps 4 --stages="${STAGES:-2,3}" --interior 1 \
                --merge-ahead -1 --rows-first "${ROWS:-0,1,2}" --B "${B:-1,8,64}" --L "${L:-8192,32768}" \
                --note "tree ${OPCONTRACT_COMMIT:-unknown}" \
                --out "$OUT/attention_decode_rows_first_${LABEL}.json" ;;
        merge-cuts)  # split decode's merge: channels a program, its warps, reading ahead
            stage merge-cuts "${MERGE_LIMIT:-300}" python3 benchmarks/attention_decode_explore.py \
                --kernel-us --split 1 --block-m 16 --warps 4 --stages=-1 --interior 1 \
                --merge-ahead="${AHEADS:--1,1}" --rows-first "${ROWS:-1}" \
                --merge-cols "${COLS:-8,16,32}" --merge-warps "${MWARPS:-1,2}" \
                --B "${B:-1,8,64}" --L "${L:-8192,32768}" --note "tree ${OPCONTRACT_COMMIT:-unknown}" \
                --out "$OUT/attention_decode_merge_cuts_${LABEL}.json" ;;
        forward-ceiling)  # the ladder's chunked kernel with the contract's block arithmetic, and ours
            stage forward-ceiling "${CEILING_LIMIT:-300}" python3 benchmarks/attention_triton_ceiling.py \
                --peers 0 --ours 0 --only merge_reg --lengths "${L:-8192,16384}" \
                --out "$OUT/attention_triton_ceiling_arith_${LABEL}.json"
            stage forward-kernel 200 python3 benchmarks/attention_kernel_time.py --configs '[{}]' \
                --lengths "${L:-8192,16384}" --note "tree ${OPCONTRACT_COMMIT:-unknown}" \
                --out "$OUT/attention_kernel_time_arith_${LABEL}.json" ;;
        merge-default)  # split decode at the default merge (merge_cols -1) against 32 channels
            stage merge-default "${MERGE_LIMIT:-150}" python3 benchmarks/attention_decode_explore.py \
                --kernel-us --split 1 --block-m 16 --warps 4 --stages=-1 --interior 1 \
                --merge-ahead=-1 --rows-first 1 --merge-cols=-1,32 --merge-warps 2 \
                --B "${B:-1,8,64,256}" --L "${L:-8192,32768}" --note "tree ${OPCONTRACT_COMMIT:-unknown}" \
                --out "$OUT/attention_decode_merge_default_${LABEL}.json" ;;
        cute-loads)  # what a CuTe chunk program streams (TMA, a producer warp): needs the CuTe site
            stage cute-loads "${CUTE_LOADS_LIMIT:-200}" python3 benchmarks/attention_decode_cute_loads.py \
                --B "${B:-1,8,64}" --L "${L:-8192,32768}" --stages "${STAGES:-2,3,4}" \
                --out "$OUT/attention_decode_cute_loads_${LABEL}.json" ;;
        decode-ceiling)  # what a Triton chunk program reads: loads, products, softmax, the row sum
            stage decode-ceiling "${CEILING_LIMIT:-240}" python3 benchmarks/attention_decode_ceiling.py \
                --B "${B:-1,8,64}" --L "${L:-8192}" --note "tree ${OPCONTRACT_COMMIT:-unknown}" \
                --out "$OUT/attention_decode_ceiling_${LABEL}.json" ;;
        sweep-attention-decode) sweep attention-decode triton.attention 32 70 540 --max-batch 64 ;;
        attention-decode) stage attention-decode 400 python3 benchmarks/attention.py --parts decode \
            --note "tree ${OPCONTRACT_COMMIT:-unknown}" --out "$OUT/attention_decode_h200_${LABEL}.json" ;;
        decode-split) stage decode-split 240 python3 benchmarks/decode_host_split.py \
            --batch "${BATCH:-16}" --note "tree ${OPCONTRACT_COMMIT:-unknown}" \
            --out "$OUT/decode_host_split_h200_${LABEL}.json" ;;
        hf-static)  # generate() with the static cache under CUDA graphs: the GPU test, then
            # eager and static decode tokens/s, stock and patched (4 layers, real width)
            stage hf-static-test 300 python3 -m pytest -q -m gpu \
                "$TREE/tests/test_hf_static_cache.py" -p no:cacheprovider
            stage hf-static 500 python3 benchmarks/hf_throughput_gpu.py --train "" \
                --decode "${DECODE:-1,16,64}" --decode-modes "${DECODE_MODES:-eager,static}" \
                --providers "${PROVIDERS:-stock,opcontract}" \
                --note "tree ${OPCONTRACT_COMMIT:-unknown}" --out "$OUT/hf_decode_static_h200.json" ;;
        decode-profile)  # GPU time of generate() by kernel, stock and patched, eager and static
            stage decode-profile 500 python3 benchmarks/decode_gpu_profile.py \
                --batch "${DECODE:-1,64}" --note "tree ${OPCONTRACT_COMMIT:-unknown}" \
                --out "$OUT/decode_gpu_profile_h200.json" ;;
        cute-head)  # the CuTe heads against triton.fused bitwise, then their training time
            stage cute-head-tests 330 python3 -m pytest -q -m gpu "$TREE/tests/test_cute_head.py" \
                -p no:cacheprovider
            stage cute-head-train 300 python3 benchmarks/softcap_logprob_train.py \
                --T ${HEAD_T:-8192 16384} --rep-ms 400 --backend cute.fused \
                --out "$OUT/softcap_logprob_train_cute_${LABEL}.json" ;;
        cute-head-forward)  # the forward alone, the CuTe head and triton.fused in one call
            for b in cute.fused triton.fused; do
                stage "forward-$b" 200 python3 benchmarks/softcap_logprob_forward.py \
                    --T 2048 8192 16384 --rep-ms 200 --backend "$b" \
                    --out "$OUT/softcap_logprob_forward_${b/./_}_${LABEL}.json"
            done ;;
        hf-train)  # 4-layer real-width training steps, opcontract and Liger side by side
            stage hf-train "${HF_TRAIN_LIMIT:-420}" python3 benchmarks/hf_throughput_gpu.py \
                --train "${TRAIN:-4096,8192,16384}" --decode "" --providers "${PROVIDERS:-opcontract,liger}" \
                --note "tree ${OPCONTRACT_COMMIT:-unknown}" --out "$OUT/hf_train_${LABEL}.json" ;;
        head-probe)  # which head serves the HF labels loss, and each forced one's time
            stage head-probe 240 python3 benchmarks/head_dispatch_probe.py --T "${HEAD_T:-8191,8192}" \
                --backends "${HEAD_BACKENDS:-default,triton.fused_ce,cute.fused_ce}" \
                --out "$OUT/head_dispatch_probe_${LABEL}.json" ;;
        hf-profile)  # the training step's kernels by name
            stage hf-profile 300 python3 benchmarks/hf_train_profile.py --T 8192 \
                --providers "${PROVIDERS:-opcontract}" --top 16 \
                --out "$OUT/hf_train_profile_${LABEL}.json" ;;
        cute-head-parity)  # the CuTe heads' bits against triton.fused only (T = 300, 1100, 2048)
            stage cute-head-parity 240 python3 -m pytest -q -m gpu "$TREE/tests/test_cute_head.py" \
                -k "give_triton_fused_bits or g_from_a_cute_acc" -p no:cacheprovider ;;
        g-parity)  # where g from a CuTe acc leaves the fused kernel's bits, element by element
            stage g-parity 120 python3 benchmarks/cute_head_g_parity.py \
                --out "$OUT/cute_head_g_parity_${LABEL}.json" ;;
        sampler-apart)  # the sampler head at decode sizes with its logits' GEMM apart, by tile
            # (SAMPLER_CUTE= leaves out the CuTe GEMM's tiles, for a machine without CUTLASS DSL)
            stage sampler-apart 300 python3 benchmarks/sampler_head_apart_explore.py ${SAMPLER_CUTE---cute} \
                --T "${SAMPLER_T:-1,16,64}" --note "tree ${OPCONTRACT_COMMIT:-unknown}" \
                --out "$OUT/sampler_head_apart_${LABEL}.json" ;;
        cute) stage cute "${CUTE_LIMIT:-300}" python3 benchmarks/cute_gemm_probe.py --out "$OUT/cute_gemm_h200.json" ;;
        *) echo "unknown stage $s"; exit 2 ;;
    esac
done
