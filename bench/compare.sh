#!/usr/bin/env bash
# servelm against its peers, one server at a time, on the same model, prompts and load:
#
#   bench/compare.sh                          # servelm and every installed peer
#   bench/compare.sh servelm vllm_cpu         # just these
#   bench/compare.sh --shape qwen2.5-0.5b servelm vllm_cpu llama_server
#   NUM_PROMPTS=128 OUT=/tmp/cmp bench/compare.sh
#
# --shape (or SERVELM_BENCH_SHAPE) picks the model: smollm2-135m (default, the
# bundled SmolLM2-135M-Instruct), or a random-weight model of a real shape,
# qwen2.5-0.5b or llama-3.2-1b (bench/export_shape.py makes it on first use).
#
# First the machine's limits are measured (bench/machine_limits.py: bf16 and
# int8 GEMM peaks, memory read bandwidth) while no server runs. Then each
# server (a script in bench/peers/) is started on a free port on 127.0.0.1,
# its process tree's memory sampled idle for $IDLE_SECONDS, loaded by
# `servelm bench serve` (chat endpoint, 128 prompt tokens, 64 output tokens
# with ignore_eos, concurrency 1, 8 and 32) while its memory is sampled
# (bench/process_memory.py), and stopped before the next one starts. Results:
# $OUT/<server>.json, $OUT/meta/ (limits.json, model-config.json,
# memory-<server>.json) and $OUT/table.md, the tables bench/compare_table.py
# makes of them (also printed): throughput and latency, each level against
# the machine's limits, and memory.
#
# ROUNDS=N runs the whole list N times, round r starting at the list's r-th
# server (so with N = the number of servers each runs first once: on a VM the
# first is often the slowest of its kind), each round into $OUT/round-R/ with
# its own table.md; then bench/compare_rounds.py prints $OUT/rounds.md: the
# first server's throughput over each other's, and their TTFT p50 over its,
# per round and the median.
#
# Servers: servelm (--dtype auto), servelm:bf16 (--dtype bfloat16),
# servelm:fp32 (--dtype float32), servelm:int8 (--quantization int8),
# servelm:w8a8 (--quantization w8a8), servelm:bf16-kv8 and servelm:w8a8-kv8 (the same
# with --kv-cache-dtype int8), vllm_cpu, llama_server
# (F16 GGUF), llama_server:q8_0, transformers_serve. A peer that is not
# installed is skipped with a note (install it: bench/peers/NAME.sh install).
#
# Env: OUT (default $CACHE/results/compare-SHAPE-DATE), ROUNDS (1), NUM_PROMPTS (per level,
# default 64), CONCURRENCY (default 1,8,32), INPUT_LEN (128), OUTPUT_LEN (64),
# WARMUP (requests before the first level, default 4), BENCH_ARGS (extra flags
# for `servelm bench serve`), TOKENIZER (builds the prompts, so every server
# gets the same ones; default the bundled smollm2-135m-instruct, whose
# tokens the shapes' padded tokenizers encode alike), LIMITS_ARGS (extra
# flags for bench/machine_limits.py, e.g. "--repeats 3"), IDLE_SECONDS (5),
# LOAD_MEMORY_INTERVAL (seconds between memory samples under load, default 5:
# reading a multi-GiB server's smaps_rollup takes ~50 ms of kernel time, which
# at every 0.5 s took ~10% from a server on two cores).
set -euo pipefail

if [[ ${1:-} == --shape ]]; then
    [[ $# -ge 2 ]] || { echo "usage: $0 [--shape NAME] [SERVER...]" >&2; exit 2; }
    export SERVELM_BENCH_SHAPE=$2
    shift 2
fi

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=peers/common.sh
source "$BENCH_DIR/peers/common.sh"

OUT=${OUT:-$CACHE/results/compare-$SHAPE-$(date +%Y%m%d-%H%M%S)}
NUM_PROMPTS=${NUM_PROMPTS:-64}
CONCURRENCY=${CONCURRENCY:-1,8,32}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-64}
WARMUP=${WARMUP:-4}
ROUNDS=${ROUNDS:-1}
TOKENIZER=${TOKENIZER:-smollm2-135m-instruct}
IDLE_SECONDS=${IDLE_SECONDS:-5}
PY=$REPO_ROOT/.venv/bin/python
DEFAULT_SERVERS=(servelm servelm:int8 vllm_cpu llama_server llama_server:q8_0 transformers_serve)
SERVERS=("$@")
[[ ${#SERVERS[@]} -gt 0 ]] || SERVERS=("${DEFAULT_SERVERS[@]}")

mkdir -p "$OUT/meta"
CURRENT=""  # the peer script of the server now running, for the trap
SAMPLER=""  # the PID of the memory sampler now running

stop_sampler() {
    if [[ -n $SAMPLER ]]; then
        kill -TERM "$SAMPLER" 2>/dev/null || true
        wait "$SAMPLER" || log "the memory sampler failed; see above"
        SAMPLER=""
    fi
}

stop_current() {
    stop_sampler
    if [[ -n $CURRENT ]]; then
        "$CURRENT" stop || true
        CURRENT=""
    fi
}
trap stop_current EXIT
trap 'stop_current; exit 130' INT TERM

# `servelm bench serve` with this script's SERVELM_BENCH_* variables out of its
# environment (servelm's CLI rejects SERVELM_* variables that are no setting).
servelm_clean() {
    local unset_args=() var
    for var in $(compgen -e); do
        case $var in SERVELM_BENCH_* | SERVELM_SERVE_*) unset_args+=(-u "$var") ;; esac
    done
    env "${unset_args[@]}" "$REPO_ROOT/.venv/bin/servelm" "$@"
}

# The model (its config.json, for the FLOP and byte accounting) and the machine's
# limits, measured before any server starts.
ensure_models
cp "$HF_MODEL_DIR/config.json" "$OUT/meta/model-config.json"
log "measuring the machine's limits (bench/machine_limits.py)"
# shellcheck disable=SC2086
"$PY" "$BENCH_DIR/machine_limits.py" --json "$OUT/meta/limits.json" ${LIMITS_ARGS:-} ||
    log "the limits were not measured; the table against them is left out"

# One server: started, its memory sampled, loaded, stopped; results in $2.
run_server() {
    local server=$1 dir=$2 peer variant script label port memory pid variant_env
    peer=${server%%:*}
    variant=${server#"$peer"}
    variant=${variant#:}
    script=$BENCH_DIR/peers/$peer.sh
    label=${peer//_/-}${variant:+-$variant}
    if [[ ! -x $script ]]; then
        log "skipping $server: no $script"
        return
    fi
    if ! "$script" available; then
        log "skipping $server: not installed (run: $script install)"
        return
    fi
    # A variant is one more env var for the peer script's start.
    variant_env=()
    case $server in
    servelm:bf16) variant_env=("SERVELM_SERVE_ARGS=${SERVELM_SERVE_ARGS:+$SERVELM_SERVE_ARGS }--dtype bfloat16") ;;
    servelm:fp32) variant_env=("SERVELM_SERVE_ARGS=${SERVELM_SERVE_ARGS:+$SERVELM_SERVE_ARGS }--dtype float32") ;;
    servelm:int8) variant_env=("SERVELM_SERVE_ARGS=${SERVELM_SERVE_ARGS:+$SERVELM_SERVE_ARGS }--quantization int8") ;;
    servelm:w8a8) variant_env=("SERVELM_SERVE_ARGS=${SERVELM_SERVE_ARGS:+$SERVELM_SERVE_ARGS }--quantization w8a8") ;;
    servelm:bf16-kv8) variant_env=("SERVELM_SERVE_ARGS=${SERVELM_SERVE_ARGS:+$SERVELM_SERVE_ARGS }--dtype bfloat16 --kv-cache-dtype int8") ;;
    servelm:w8a8-kv8) variant_env=("SERVELM_SERVE_ARGS=${SERVELM_SERVE_ARGS:+$SERVELM_SERVE_ARGS }--quantization w8a8 --kv-cache-dtype int8") ;;
    llama_server:?*) variant_env=("LLAMA_MODEL=$variant") ;;
    *:?*)
        log "skipping $server: unknown variant"
        return
        ;;
    esac
    port=$(free_port)
    log "=== $label on port $port ==="
    echo "$label" >>"$dir/order"
    CURRENT=$script
    if env "${variant_env[@]}" "$script" start "$port"; then
        memory=$dir/meta/memory-$label.json
        rm -f "$memory"
        pid=$("$script" pid)
        "$PY" "$BENCH_DIR/process_memory.py" "$pid" --phase idle --seconds "$IDLE_SECONDS" --out "$memory" ||
            log "$label: no idle memory sample"
        "$PY" "$BENCH_DIR/process_memory.py" "$pid" --phase load --interval "${LOAD_MEMORY_INTERVAL:-5}" \
            --out "$memory" &
        SAMPLER=$!
        # shellcheck disable=SC2086
        servelm_clean bench serve --base-url "http://127.0.0.1:$port" --model "$SERVED_MODEL_NAME" \
            --endpoint chat --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
            --num-prompts "$NUM_PROMPTS" --concurrency "$CONCURRENCY" --warmup "$WARMUP" \
            --tokenizer "$TOKENIZER" --result-json "$dir/$label.json" ${BENCH_ARGS:-} ||
            log "$label: the benchmark failed; see above"
    else
        log "$label did not start; its log is in $RUN_DIR"
    fi
    stop_current
}

if [[ $ROUNDS -eq 1 ]]; then
    for server in "${SERVERS[@]}"; do run_server "$server" "$OUT"; done
else
    # Round r starts at the r-th server of the list and wraps around: whichever runs first in a round
    # (often the slowest of its kind on a VM) differs from round to round.
    for ((round = 1; round <= ROUNDS; round++)); do
        dir=$OUT/round-$round
        mkdir -p "$dir/meta"
        cp "$OUT/meta/"*.json "$dir/meta/" 2>/dev/null || true
        log "=== round $round of $ROUNDS ==="
        for ((i = 0; i < ${#SERVERS[@]}; i++)); do
            run_server "${SERVERS[(i + round - 1) % ${#SERVERS[@]}]}" "$dir"
        done
        if compgen -G "$dir/*.json" >/dev/null; then
            "$PY" "$BENCH_DIR/compare_table.py" "$dir" >"$dir/table.md"
        fi
    done
    "$PY" "$BENCH_DIR/compare_rounds.py" "$OUT"/round-* | tee "$OUT/rounds.md"
    log "results in $OUT (each round's in round-N/, with its table.md)"
    exit 0
fi

if compgen -G "$OUT/*.json" >/dev/null; then
    "$PY" "$BENCH_DIR/compare_table.py" "$OUT" | tee "$OUT/table.md"
    log "results in $OUT"
else
    log "no results in $OUT"
    exit 1
fi
