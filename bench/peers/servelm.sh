#!/usr/bin/env bash
# servelm itself, with the same interface as the peers:
#   install | start PORT | stop | available | model-name
#
#   bench/peers/servelm.sh start 8100   # this repo's .venv/bin/servelm serve on the bundled GGUF
#   SERVELM_BENCH_SHAPE=qwen2.5-0.5b bench/peers/servelm.sh start 8100   # on that shape's bf16 folder
#   bench/peers/servelm.sh stop
#
# No embedding model, and the model served under the same name as the peers'.
# Env: SERVELM_SERVE_MODEL (default: smollm2-135m-instruct, the bundled GGUF,
# or with SERVELM_BENCH_SHAPE the shape's bf16 folder, as the peers load it;
# the SmolLM2 bf16 export folder works too), SERVELM_SERVE_ARGS (extra flags,
# e.g. "--dtype bfloat16 --max-num-seqs 32").
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

NAME=servelm
SERVELM=$REPO_ROOT/.venv/bin/servelm

do_install() {
    if do_available; then
        log "servelm is installed: $SERVELM"
        return 0
    fi
    log "setting up this repo's .venv (make setup)"
    nice -n 19 make -C "$REPO_ROOT" setup
}

do_available() { [[ -x $SERVELM ]]; }

do_start() {
    local port=$1 model=${SERVELM_SERVE_MODEL:-}
    if [[ -z $model && $SHAPE == smollm2-135m ]]; then
        model=smollm2-135m-instruct
    elif [[ -z $model ]]; then
        ensure_models
        model=$HF_MODEL_DIR
    fi
    # `servelm serve` rejects SERVELM_* variables that name no setting, and these
    # scripts' own variables share the prefix: keep them out of its environment.
    local unset_args=() var
    for var in $(compgen -e); do
        case $var in SERVELM_BENCH_* | SERVELM_SERVE_*) unset_args+=(-u "$var") ;; esac
    done
    # shellcheck disable=SC2086
    start_bg "$NAME" env "${unset_args[@]}" "$SERVELM" serve \
        --model "$model" --embedding-model none \
        --served-model-name "$SERVED_MODEL_NAME" --host 127.0.0.1 --port "$port" \
        ${SERVELM_SERVE_ARGS:-}
    wait_ready "$NAME" "$port" /ready
}

peer_main "$NAME" "$@"
