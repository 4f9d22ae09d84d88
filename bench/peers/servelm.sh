#!/usr/bin/env bash
# servelm itself, with the same interface as the peers:
#   install | start PORT | stop | available | model-name
#
#   bench/peers/servelm.sh start 8100   # this repo's .venv/bin/servelm serve on the bundled GGUF
#   bench/peers/servelm.sh stop
#
# No embedding model, and the model served under the same name as the peers'.
# Env: SERVELM_SERVE_MODEL (default smollm2-135m-instruct, the bundled GGUF; the
# bf16 export folder works too), SERVELM_SERVE_ARGS (extra flags, e.g.
# "--dtype bfloat16 --max-num-seqs 32").
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
    local port=$1
    # `servelm serve` rejects SERVELM_* variables that name no setting, and these
    # scripts' own variables share the prefix: keep them out of its environment.
    local unset_args=() var
    for var in $(compgen -e); do
        case $var in SERVELM_BENCH_* | SERVELM_SERVE_*) unset_args+=(-u "$var") ;; esac
    done
    # shellcheck disable=SC2086
    start_bg "$NAME" env "${unset_args[@]}" "$SERVELM" serve \
        --model "${SERVELM_SERVE_MODEL:-smollm2-135m-instruct}" --embedding-model none \
        --served-model-name "$SERVED_MODEL_NAME" --host 127.0.0.1 --port "$port" \
        ${SERVELM_SERVE_ARGS:-}
    wait_ready "$NAME" "$port" /ready
}

peer_main "$NAME" "$@"
