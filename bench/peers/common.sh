# shellcheck shell=bash disable=SC2034  # variables here are for the peer scripts
# Shared helpers for the peer scripts in bench/peers/. Source it; don't run it.
#
# Everything a peer needs (its virtualenv, the exported models, logs, PID files)
# lives in a cache directory outside the repository:
#   ${SERVELM_BENCH_CACHE:-$HOME/.cache/servelm-bench}/
#     models/   bf16 HF folder and GGUF files (bench/export_model.py and
#               bench/export_shape.py write them)
#     venvs/    one virtualenv per peer
#     src/      sources a peer builds from (llama.cpp)
#     run/      <peer>.pid and <peer>.log of the running server
#
# Servers listen on 127.0.0.1 only. A server is started in its own session
# (setsid), so its PID is also its process-group id: `stop` signals that group,
# which reaches the worker processes a server forks (vLLM's engine core) and
# nothing else. No pkill, no killall.

set -euo pipefail

PEERS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$PEERS_DIR/../.." && pwd)
CACHE=${SERVELM_BENCH_CACHE:-$HOME/.cache/servelm-bench}
MODELS_DIR=$CACHE/models
VENVS_DIR=$CACHE/venvs
SRC_DIR=$CACHE/src
RUN_DIR=$CACHE/run

# The model every server runs: SmolLM2-135M-Instruct (the bundled model, exported)
# by default; SERVELM_BENCH_SHAPE=qwen2.5-0.5b or llama-3.2-1b picks a
# random-weight model of that real shape (bench/export_shape.py).
SHAPE=${SERVELM_BENCH_SHAPE:-smollm2-135m}
case $SHAPE in
smollm2-135m) MODEL_STEM=smollm2-135m-instruct ;;
*) MODEL_STEM=$SHAPE-random ;;
esac
HF_MODEL_DIR=$MODELS_DIR/$MODEL_STEM-bf16
GGUF_F16=$MODELS_DIR/$MODEL_STEM-f16.gguf
GGUF_Q8_0=$MODELS_DIR/$MODEL_STEM-q8_0.gguf

# One name for the model on every server, so a client addresses them alike.
SERVED_MODEL_NAME=${SERVELM_BENCH_MODEL_NAME:-$MODEL_STEM}
# Seconds a server may take to answer its readiness probe after `start`.
START_TIMEOUT=${SERVELM_BENCH_START_TIMEOUT:-600}
# Seconds `stop` waits after SIGTERM before SIGKILL.
STOP_TIMEOUT=${SERVELM_BENCH_STOP_TIMEOUT:-30}
# The Python that makes the peers' virtualenvs.
PEER_PYTHON=${SERVELM_BENCH_PYTHON:-python3}

# Heavy builds share two cores with other people's tests: lowest priority, two jobs.
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
export MAKEFLAGS=${MAKEFLAGS:--j2}
export MAX_JOBS=${MAX_JOBS:-2}

log() { echo "[$(date +%H:%M:%S)] $*" >&2; }
die() { log "error: $*"; exit 1; }

peer_venv() { echo "$VENVS_DIR/$1"; }

# make_venv NAME: create $VENVS_DIR/NAME (if missing) with an up-to-date pip.
make_venv() {
    local venv
    venv=$(peer_venv "$1")
    if [[ ! -x $venv/bin/python ]]; then
        mkdir -p "$VENVS_DIR"
        log "creating virtualenv $venv"
        "$PEER_PYTHON" -m venv "$venv"
        nice -n 19 "$venv/bin/python" -m pip install -q --upgrade pip
    fi
}

# pip_install NAME ARGS...: pip install into the peer's venv at the lowest priority.
pip_install() {
    local venv
    venv=$(peer_venv "$1")
    shift
    nice -n 19 "$venv/bin/python" -m pip install "$@"
}

# ensure_models: export the benchmark model of $SHAPE (bf16 HF folder, F16 and
# Q8_0 GGUF) if any part is missing.
ensure_models() {
    if [[ ! -f $HF_MODEL_DIR/model.safetensors || ! -f $GGUF_F16 || ! -f $GGUF_Q8_0 ]]; then
        log "exporting the benchmark model ($SHAPE) into $MODELS_DIR"
        if [[ $SHAPE == smollm2-135m ]]; then
            nice -n 19 "$REPO_ROOT/.venv/bin/python" "$REPO_ROOT/bench/export_model.py" --cache "$CACHE"
        else
            nice -n 19 "$REPO_ROOT/.venv/bin/python" "$REPO_ROOT/bench/export_shape.py" "$SHAPE" --cache "$CACHE"
        fi
    fi
}

pid_file() { echo "$RUN_DIR/$1.pid"; }
log_file() { echo "$RUN_DIR/$1.log"; }

# running NAME: exit 0 if the PID in NAME's PID file is alive.
running() {
    local pf pid
    pf=$(pid_file "$1")
    [[ -f $pf ]] || return 1
    pid=$(cat "$pf")
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null
}

# start_bg NAME CMD...: run CMD in the background in a new session, output to
# run/NAME.log, PID to run/NAME.pid. Refuses if NAME is already running.
start_bg() {
    local name=$1
    shift
    mkdir -p "$RUN_DIR"
    if running "$name"; then
        die "$name is already running (PID $(cat "$(pid_file "$name")")); stop it first"
    fi
    local lf
    lf=$(log_file "$name")
    log "starting $name: $* (log: $lf)"
    # setsid forks when its caller already leads a process group (job control on),
    # so $! is not always the server: the shell it starts writes its own PID, then
    # execs the server in place, which keeps that PID (= the new process group).
    local pf
    pf=$(pid_file "$name")
    rm -f "$pf"
    # shellcheck disable=SC2016  # expanded by the inner shell
    setsid bash -c 'echo $$ >"$0"; exec "$@"' "$pf" "$@" >"$lf" 2>&1 </dev/null &
    for _ in $(seq 50); do
        [[ -s $pf ]] && break
        sleep 0.1
    done
    [[ -s $pf ]] || die "$name did not start (no PID written to $pf)"
}

# wait_ready NAME PORT [PATH]: poll http://127.0.0.1:PORT/PATH (default
# /v1/models) until it answers 200, the server dies, or START_TIMEOUT passes.
wait_ready() {
    local name=$1 port=$2 path=${3:-/v1/models}
    local pid deadline=$((SECONDS + START_TIMEOUT))
    pid=$(cat "$(pid_file "$name")")
    while ((SECONDS < deadline)); do
        if ! kill -0 "$pid" 2>/dev/null; then
            log "$name (PID $pid) exited before it was ready; last lines of its log:"
            tail -n 30 "$(log_file "$name")" >&2 || true
            rm -f "$(pid_file "$name")"
            return 1
        fi
        if curl -sf -o /dev/null --max-time 5 "http://127.0.0.1:$port$path"; then
            log "$name ready on http://127.0.0.1:$port (PID $pid, after ${SECONDS}s of this script)"
            return 0
        fi
        sleep 1
    done
    log "$name not ready after ${START_TIMEOUT}s; stopping it. Last lines of its log:"
    tail -n 30 "$(log_file "$name")" >&2 || true
    stop_by_pidfile "$name"
    return 1
}

# group_alive PGID: exit 0 if any process of that process group is alive.
group_alive() { kill -0 -- "-$1" 2>/dev/null; }

# stop_by_pidfile NAME: SIGTERM the process group NAME's PID leads, wait up to
# STOP_TIMEOUT seconds, then SIGKILL what is left. Removes the PID file.
stop_by_pidfile() {
    local name=$1 pf pid
    pf=$(pid_file "$name")
    if [[ ! -f $pf ]]; then
        log "$name: no PID file ($pf); nothing to stop"
        return 0
    fi
    pid=$(cat "$pf")
    if [[ -z $pid ]] || ! group_alive "$pid"; then
        log "$name: PID $pid is not running"
        rm -f "$pf"
        return 0
    fi
    log "stopping $name (PID $pid and its process group)"
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + STOP_TIMEOUT))
    while group_alive "$pid" && ((SECONDS < deadline)); do
        sleep 0.5
    done
    if group_alive "$pid"; then
        log "$name still running after ${STOP_TIMEOUT}s; SIGKILL"
        kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
        sleep 1
    fi
    if group_alive "$pid"; then
        log "$name: process group $pid survived SIGKILL"
        return 1
    fi
    rm -f "$pf"
    log "$name stopped"
}

# free_port: print a TCP port that is free on 127.0.0.1 right now.
free_port() {
    "$PEER_PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# preload_libs LIB...: print a colon-joined LD_PRELOAD of the given files that
# exist (missing ones are skipped with a note, so a machine without them still runs).
preload_libs() {
    local out="" lib
    for lib in "$@"; do
        if [[ -n $lib && -f $lib ]]; then
            out=${out:+$out:}$lib
        else
            log "note: ${lib:-a preload library} not found; running without it"
        fi
    done
    echo "$out"
}

# peer_main NAME "$@": dispatch the standard subcommands to functions the peer
# script defines: do_install, do_start PORT, do_available. stop, pid and
# model-name are shared.
peer_main() {
    local name=$1
    shift
    local cmd=${1:-}
    case $cmd in
    install) do_install ;;
    start)
        [[ $# -ge 2 ]] || die "usage: $0 start PORT"
        do_available || die "$name is not installed; run: $0 install"
        do_start "$2"
        ;;
    stop) stop_by_pidfile "$name" ;;
    pid)
        running "$name" || die "$name is not running"
        cat "$(pid_file "$name")"
        ;;
    available) do_available ;;
    model-name) echo "$SERVED_MODEL_NAME" ;;
    *)
        echo "usage: $0 {install|start PORT|stop|pid|available|model-name}" >&2
        exit 2
        ;;
    esac
}
