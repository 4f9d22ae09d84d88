#!/usr/bin/env bash
# `transformers serve --continuous-batching` as a peer of servelm:
#   install | start PORT | stop | available | model-name
#
#   bench/peers/transformers_serve.sh install     # own venv under $CACHE/venvs/transformers-serve
#   bench/peers/transformers_serve.sh start 8102  # serves the bf16 export on 127.0.0.1:8102
#   bench/peers/transformers_serve.sh stop
#
# `transformers serve` loads models by hub id from the HF cache, so start lays the
# bf16 export out as $CACHE/hf-hub/models--<name>/snapshots/<rev>/ (symlinks,
# no copy) and runs with HF_HUB_CACHE there and HF_HUB_OFFLINE=1: the server
# then answers to the same model name as the other peers and never goes online.
# It runs through transformers_serve_launcher.py, which lets requests carry
# vLLM's `ignore_eos` (stock transformers serve answers 422 to unknown fields).
#
# Env: TRANSFORMERS_SPEC (pip requirement, default transformers[serving]==5.23.0),
# TORCH_SPEC (default torch==2.13.0, the CPU wheel on this disk), TRANSFORMERS_SERVE_EXTRA_ARGS.
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

NAME=transformers-serve
VENV=$(peer_venv "$NAME")
STAMP=$VENV/.servelm-bench-installed
HF_HUB=$CACHE/hf-hub

do_install() {
    if do_available; then
        log "$NAME already installed in $VENV"
        return 0
    fi
    make_venv "$NAME"
    local t0=$SECONDS
    # torch first, on its own, so the resolver takes the CPU wheel and no CUDA build.
    pip_install "$NAME" "${TORCH_SPEC:-torch==2.13.0}"
    pip_install "$NAME" "${TRANSFORMERS_SPEC:-transformers[serving]==5.23.0}"
    "$VENV/bin/python" -c 'import transformers, torch, fastapi, uvicorn; print("transformers", transformers.__version__, "torch", torch.__version__)'
    touch "$STAMP"
    log "$NAME installed in $((SECONDS - t0))s; $(du -sh "$VENV" | cut -f1) in $VENV"
}

do_available() { [[ -f $STAMP && -x $VENV/bin/python ]]; }

# hub_layout: $HF_HUB/models--NAME/{refs/main,snapshots/REV/*} pointing at the export.
hub_layout() {
    local repo=$HF_HUB/models--$SERVED_MODEL_NAME rev f
    rev=$(cat "$HF_MODEL_DIR"/*.json | sha1sum | cut -c1-40)
    if [[ -f $repo/refs/main && $(cat "$repo/refs/main") == "$rev" && -e $repo/snapshots/$rev/model.safetensors ]]; then
        return 0
    fi
    rm -rf "$repo"
    mkdir -p "$repo/refs" "$repo/blobs" "$repo/snapshots/$rev"
    printf '%s' "$rev" >"$repo/refs/main"
    for f in "$HF_MODEL_DIR"/*; do
        ln -s "$f" "$repo/snapshots/$rev/$(basename "$f")"
    done
    log "laid out $HF_MODEL_DIR as hub model '$SERVED_MODEL_NAME' in $HF_HUB"
}

do_start() {
    local port=$1
    ensure_models
    hub_layout
    # Run from the cache dir: a folder named like the model in the working
    # directory would shadow the hub id.
    cd "$CACHE" || exit 1
    # shellcheck disable=SC2086
    start_bg "$NAME" env \
        HF_HUB_CACHE="$HF_HUB" HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 \
        "$VENV/bin/python" "$PEERS_DIR/transformers_serve_launcher.py" \
        "$SERVED_MODEL_NAME" --continuous-batching --device cpu --dtype bfloat16 \
        --host 127.0.0.1 --port "$port" --log-level info ${TRANSFORMERS_SERVE_EXTRA_ARGS:-}
    wait_ready "$NAME" "$port" /v1/models
}

peer_main "$NAME" "$@"
