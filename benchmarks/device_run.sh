#!/bin/bash
# The GPU machine's steps: correctness grid, then the benchmark (with the plan sweep).
# Usage (repo root, on the GPU machine):
#   OUT=dir bash benchmarks/device_run.sh [check|tests|bench|bench-nosweep|sparse|small|routes|
#     suite|sanitize|step-peers|v4|bench-cli|fuzz-peers|batch-invariant|v4-timing|bench-peers|
#     sparse-sweep|sparse-peers|front-budget|matrix|properties|prefill-kernels|logits|topk-short|
#     step-peers-quick|topk-probe|code-fetch|topk-serving]...
# BUNDLE=path: also pack everything under $OUT into one .tgz there (the device returns at
# most 8 files: BUNDLE=$OUT/all.tgz OUT=/tmp/o keeps every result of a many-step run; the
# assignments expand left to right, so BUNDLE reads the device's $OUT before OUT changes).
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv \
  | tee "$OUT/gpu.txt"
# mla conform on each target of $3, one process a target, side by side (the reference's float64
# side runs on the CPU), within $2 seconds each: $OUT/$1_<target>.{md,json,log}; the arguments
# after $3 go to every run
conform_each() {
  local prefix=$1 limit=$2 targets=$3 t p pids=()
  shift 3
  for t in $targets; do
    timeout "$limit" python -m mla conform --target "$t" --device cuda "$@" \
      --out "$OUT/${prefix}_$t.md" --json "$OUT/${prefix}_$t.json" > "$OUT/${prefix}_$t.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(check bench)
for step in "${steps[@]}"; do
  case $step in
    # the GPU check as benchmarks/results/checks/ records it, its kernels in CHECK_JOBS
    # processes at once (default 4) within CHECK_TIMEOUT seconds (default 580): one process
    # took over 440 s with a cold Triton cache on an H100 on 2026-12-07, most of it compiling
    # on one CPU; 90 s warm. A machine's first call runs it alone
    check) timeout "${CHECK_TIMEOUT:-580}" python -m mla.check --jobs "${CHECK_JOBS:-4}" \
             --out "$OUT/gpu_check.json" --markdown "$OUT/gpu_check_table.md" 2>&1 \
             | tee "$OUT/check.log" ;;
    # the fused front's bf16 error over 10 seeds (mla.compare's budget sits at about twice it:
    # tests/test_check_budgets.py), committed as benchmarks/results/checks/; about 260 s (the
    # float64 reference of V3.2's widths on the CPU, 50 cases)
    front-budget) timeout 420 python -m mla.check --kernel sparse_front --seeds 10 \
             --out "$OUT/error_budget_gpu_bfloat16_front.json" 2>&1 | tail -3 \
             | tee "$OUT/front_budget.log" ;;
    # the fast kernels' tests on the GPU: bf16 cases, and the Gluon sm_90 kernels' NaN rule
    tests) timeout 500 python -m pytest -q -p no:cacheprovider tests/test_fast_sm90.py \
             tests/test_fast_batch_invariant.py tests/test_fast_v4_decode_step.py \
             tests/test_fast_decode.py tests/test_fast_sparse.py tests/test_fast_small.py \
             tests/test_merge.py 2>&1 | tee "$OUT/tests.log" ;;
    bench) timeout 330 python -m benchmarks.run --only decode --sweep --out-dir "$OUT" 2>&1 \
             | tee "$OUT/bench.log" ;;
    sparse) timeout 200 python -m benchmarks.run --only sparse --out-dir "$OUT" 2>&1 \
             | tee "$OUT/bench_sparse.log" ;;
    # the sparse kernels' plans swept (the warp-specialized fp8_ds_mla kernel beside the default)
    sparse-sweep) timeout 400 python -m benchmarks.sparse --sweep --out "$OUT" 2>&1 \
             | tee "$OUT/sparse_sweep.log" ;;
    # DeepSeek-V3.2's sparse kernels beside FlashMLA, DeepGEMM's logits and vLLM's top-k
    # (sparse_peers_<date>.json: one row a kernel and shape)
    sparse-peers) timeout 400 python -m benchmarks.sparse_peers --out-dir "$OUT" 2>&1 \
             | tee "$OUT/sparse_peers.log" ;;
    small) timeout 200 python -m benchmarks.small --out-dir "$OUT" 2>&1 | tee "$OUT/small.log" ;;
    routes) timeout 300 python -m benchmarks.prefill_routes --out-dir "$OUT" 2>&1 \
             | tee "$OUT/routes.log" ;;
    step-peers) timeout 560 python -m benchmarks.step_peers --out-dir "$OUT" --profile-front 2>&1 | tee "$OUT/step_peers.log" ;;
    # the same on its quick shapes (decode B=32 L=32K and B=1 L=8K, prefill 2K over 16K)
    step-peers-quick) timeout 300 python -m benchmarks.step_peers --quick --out-dir "$OUT" \
             2>&1 | tee "$OUT/step_peers_quick.log" ;;
    bench-nosweep) timeout 200 python -m benchmarks.run --out-dir "$OUT" 2>&1 \
             | tee "$OUT/bench.log" ;;
    # the README's test command on the GPU machine (no interpreter): which modules fail there
    suite) timeout 560 python -m pytest -q -n 8 --dist loadfile -p no:cacheprovider -rfE \
             2>&1 | tail -80 | tee "$OUT/suite.log" ;;
    # DeepSeek-V4: the fast layer's stage checks and step, vLLM's V4/V4.1 kernels against the
    # reference, and the judge on them (peers/ built with benchmarks.peers --v4 --v41)
    v4) timeout 240 python -m benchmarks.v4_layer --out-dir "$OUT" 2>&1 | tee "$OUT/v4_layer.log"
        timeout 120 python -m benchmarks.v4_peers_check --out-dir "$OUT" 2>&1 \
          | tee "$OUT/v4_peers_check.log"
        timeout 120 python -m benchmarks.v41_codecs --out-dir "$OUT" 2>&1 | tee "$OUT/v41.log"
        timeout 150 python -m mla conform --target vllm-v4 --device cuda \
          --kernels v4_compress v4_indexer_q v4_scope_indices \
          --out "$OUT/conformance_vllm-v4.md" --json "$OUT/conformance_vllm-v4.json" ;;
    # mla bench on mla.fast beside FlashMLA, every preset
    bench-cli) timeout 400 python -m mla bench --target mla.fast --json "$OUT/bench.json" \
                 --out "$OUT/bench.md" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench_cli.log" ;;
    # mla bench of each peer target beside mla.fast and FlashMLA (the kernels each has; the
    # indexer's peers on their kernels' shapes only): a table, JSON and a plot each
    bench-peers)
      for t in ${BENCH_TARGETS:-flashmla vllm-triton mla.fast-batch-invariant \
               flashmla-batch-invariant vllm-topk deepgemm}; do
        kernels=()
        case $t in
          vllm-topk) kernels=(--kernels top_k_per_row) ;;
          deepgemm) kernels=(--kernels fp8_mqa_logits fp8_paged_mqa_logits) ;;
        esac
        timeout 300 python -m mla bench --target "$t" "${kernels[@]}" \
          --json "$OUT/bench_$t.json" --out "$OUT/bench_$t.md" --plot "$OUT/bench_$t.png" \
          2>&1 | tail -n 40 | tee "$OUT/bench_$t.log"
      done ;;
    # the V4 decode step: fast, the torch composition and vLLM's own V4 kernels
    v4-timing) timeout 400 python -m benchmarks.v4_layer --out-dir "$OUT" --timing-only 2>&1 \
             | tee "$OUT/v4_timing.log" ;;
    # what batch invariance costs: mla.fast and FlashMLA with and without split-KV
    batch-invariant) timeout 300 python -m benchmarks.batch_invariant --out-dir "$OUT" 2>&1 \
             | tee "$OUT/batch_invariant.log" ;;
    # the fuzz of every fuzzed kernel of mla.fast and the peers, one process a kernel, in
    # parallel (the reference's float64 side runs on the CPU): FUZZ_SECONDS each (default 300), going on after each
    # failure for other failure modes; one summary (benchmarks.fuzz_summary)
    fuzz-peers)
      pids=()
      # FUZZ_KERNELS="target:kernel ...": only those
      for tk in ${FUZZ_KERNELS:-mla.fast:mla_decode_paged mla.fast:sparse_mla_decode mla.fast:sparse_mla_prefill \
                mla.fast:merge_attn_states mla.fast:cp_lse_ag_out_rs flashmla:mla_decode_paged \
                flashmla:sparse_mla_decode flashmla:sparse_mla_prefill \
                vllm-triton:mla_decode_paged vllm-triton:merge_attn_states \
                vllm-triton:cp_lse_ag_out_rs mla.fast-batch-invariant:mla_decode_paged \
                mla.fast-batch-invariant:sparse_mla_decode \
                flashmla-batch-invariant:mla_decode_paged \
                flashmla-batch-invariant:sparse_mla_decode mla.fast:top_k_per_row \
                mla.fast:fp8_mqa_logits mla.fast:fp8_paged_mqa_logits vllm-topk:top_k_per_row \
                deepgemm:fp8_mqa_logits deepgemm:fp8_paged_mqa_logits} $FUZZ_MORE; do
        t=${tk%%:*}; k=${tk#*:}
        props=(); case $k in mla_decode_paged|sparse_mla_decode) props=(--properties all) ;; esac
        timeout $(( ${FUZZ_SECONDS:-300} + 240 )) python -m mla conform --target "$t" \
          --kernels "$k" --device cuda --fuzz "${FUZZ_SECONDS:-300}s" --keep-going "${props[@]}" \
          --fuzz-db "$OUT/fuzz_db/$t" --out "$OUT/fuzz_${t}_$k.md" \
          --json "$OUT/fuzz_${t}_$k.json" > "$OUT/fuzz_${t}_$k.log" 2>&1 &
        pids+=($!)
      done
      for p in "${pids[@]}"; do wait "$p"; done
      python -m benchmarks.fuzz_summary "$OUT" ;;
    # the sparse prefill kernels side by side: mla.check's prefill cases, then the prefill rows
    # of sparse_peers with the seesaw kernel (the default) and with the warp-specialized one,
    # each beside FlashMLA (seesaw_probe_<kernel>.json)
    prefill-kernels)
      timeout 200 python -m mla.check --kernel sparse_mla_prefill \
        --out "$OUT/check_prefill.json" > "$OUT/check_prefill.log" 2>&1
      tail -n 2 "$OUT/check_prefill.log"
      for k in seesaw_producer warp_specialized; do
        timeout 150 python -m benchmarks.probes.seesaw_probe "$k" 2>&1 | grep -v "^\[" \
          | tee "$OUT/seesaw_probe_$k.log"
      done ;;
    # the indexer's prefill logits beside DeepGEMM (the default plan, the Triton kernel and
    # DeepGEMM's, rows compressed; the Gluon kernel at other tiles a program); their GPU check
    # cases are check's (--kernel fp8_mqa_logits)
    logits) timeout 240 python -m benchmarks.indexer_peers --only prefill --sweep \
              --out "$OUT" 2>&1 | tee "$OUT/indexer_peers.log" | tail -n 12 ;;
    # where a held row's top-k time goes: its pieces timed alone (benchmarks.probes)
    topk-probe) timeout 300 python -m benchmarks.probes.topk_held_probe --warps 8 --out "$OUT" 2>&1 \
              | tee "$OUT/topk_probe.log" | tail -n 6 ;;
    # top-k on the decode lengths beside vLLM's kernels and the held rows' alternatives
    # (TOPK_WIDTHS: some of 8192,8193,16384,32768 alone; the kernels compiled in 12 processes)
    topk-short) timeout "${TOPK_TIMEOUT:-400}" python -m benchmarks.topk_peers --short \
                  --widths "${TOPK_WIDTHS:-}" --compile-jobs 12 --out "$OUT" 2>&1 \
              | tee "$OUT/topk_short.log" | tail -n 24 ;;
    # decode rows of 4K and 8K in logits 64K wide, with and without the rows' bound
    topk-serving) timeout 300 python -m benchmarks.topk_peers --serving --compile-jobs 12 \
                    --out "$OUT/serving" 2>&1 | tee "$OUT/topk_serving.log" | tail -n 12 ;;
    # what a kernel's code costs after the L2 flush (benchmarks.probes.code_fetch_probe)
    code-fetch) OUT="$OUT" timeout 240 python -m benchmarks.probes.code_fetch_probe 2>&1 \
              | tee "$OUT/code_fetch_probe.log" | tail -n 6 ;;
    # the catalogue on every target: conformance_<target>.{md,json}
    matrix)
      conform_each conformance 540 "${MATRIX_TARGETS:-mla.fast mla.fast-batch-invariant flashmla \
        flashmla-batch-invariant vllm-triton vllm-topk vllm-cache vllm-v4 deepgemm}"
      tail -n 3 "$OUT"/conformance_*.log ;;
    # the catalogue's decode cases held to batch invariance on the decodes that claim it (and
    # on FlashMLA's default, for contrast): properties_<target>.{md,json}
    properties)
      conform_each properties 300 \
        "${PROPERTY_TARGETS:-flashmla-batch-invariant mla.fast-batch-invariant flashmla}" \
        --kernels mla_decode_paged sparse_mla_decode --properties batch_invariance
      tail -n 1 "$OUT"/properties_*.log ;;
    sanitize) timeout 400 compute-sanitizer --tool memcheck --print-limit 20 \
                python -m mla.check --quick --out "$OUT/sanitize_check.json" 2>&1 \
                | tee "$OUT/sanitize.log" ;;
  esac
  # bundled after every step, so a run cut short by its time limit keeps the finished steps
  if [ -n "${BUNDLE:-}" ]; then
    tar czf "/tmp/bundle.$$.tgz" -C "$OUT" . && mv "/tmp/bundle.$$.tgz" "$BUNDLE"
  fi
done
