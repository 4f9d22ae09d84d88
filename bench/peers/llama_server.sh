#!/usr/bin/env bash
# llama.cpp's native llama-server as a peer of servelm:
#   install | start PORT | stop | available | model-name
#
#   bench/peers/llama_server.sh install     # builds llama-server (~15 min on 2 cores, niced, 2 jobs)
#   bench/peers/llama_server.sh start 8103  # serves the F16 GGUF on 127.0.0.1:8103, 2 threads, 32 slots
#   LLAMA_MODEL=q8_0 bench/peers/llama_server.sh start 8103   # the Q8_0 GGUF instead
#   bench/peers/llama_server.sh stop
#
# The llama.cpp source is the one vendored in the llama-cpp-python sdist (pip
# download, no build), compiled with cmake into static llama-server and
# llama-quantize binaries copied to $CACHE/venvs/llama-cpp/bin. The Python
# package's own server has no parallel slots, so it is not what we benchmark;
# LLAMA_INSTALL_PYTHON=1 also pip-installs 'llama-cpp-python[server]' into
# that venv (a second ~12 min compile).
#
# Env: LLAMA_CPP_PYTHON_VERSION (default 0.3.36), LLAMA_MODEL (f16 | q8_0 | a
# .gguf path; default f16), LLAMA_CTX (total KV context over all slots, default
# 65536 = 32 slots x 2048), LLAMA_THREADS (2), LLAMA_SLOTS (32),
# LLAMA_CMAKE_ARGS (extra cmake flags), LLAMA_SERVER_EXTRA_ARGS.
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

NAME=llama-cpp
VENV=$(peer_venv "$NAME")
STAMP=$VENV/.servelm-bench-installed
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
SDIST_DIR=$SRC_DIR/llama_cpp_python-$VERSION
LLAMA_SRC=$SDIST_DIR/vendor/llama.cpp
BUILD_DIR=$SRC_DIR/llama.cpp-$VERSION-build

do_install() {
    if do_available; then
        log "$NAME already installed in $VENV"
        return 0
    fi
    command -v cmake >/dev/null || die "cmake is missing (apt-get install -y cmake)"
    command -v g++ >/dev/null || die "a C++ compiler is missing (apt-get install -y g++)"
    make_venv "$NAME"
    local t0=$SECONDS
    mkdir -p "$SRC_DIR"
    if [[ ! -f $LLAMA_SRC/CMakeLists.txt ]]; then
        log "fetching the llama-cpp-python $VERSION sdist (llama.cpp source inside)"
        nice -n 19 "$VENV/bin/python" -m pip download --no-deps --no-binary :all: \
            "llama-cpp-python==$VERSION" -d "$SRC_DIR"
        tar -xzf "$SRC_DIR/llama_cpp_python-$VERSION.tar.gz" -C "$SRC_DIR"
    fi
    log "building llama-server and llama-quantize (nice 19, 2 jobs)"
    # No web UI (the prebuilt one is downloaded at build time; we are offline),
    # no HTTPS, static binaries that run from anywhere, tuned for this CPU.
    # shellcheck disable=SC2086
    nice -n 19 cmake -S "$LLAMA_SRC" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=ON ${LLAMA_CMAKE_ARGS:-}
    nice -n 19 cmake --build "$BUILD_DIR" --target llama-server llama-quantize -j 2
    install -m 755 "$BUILD_DIR/bin/llama-server" "$BUILD_DIR/bin/llama-quantize" "$VENV/bin/"
    if [[ ${LLAMA_INSTALL_PYTHON:-0} == 1 ]]; then
        CMAKE_ARGS="-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF" \
            pip_install "$NAME" "llama-cpp-python[server]==$VERSION"
    fi
    "$VENV/bin/llama-server" --version
    touch "$STAMP"
    log "$NAME installed in $((SECONDS - t0))s; $(du -sh "$VENV" | cut -f1) in $VENV, $(du -sh "$SRC_DIR" | cut -f1) of source and build in $SRC_DIR"
}

do_available() { [[ -f $STAMP && -x $VENV/bin/llama-server ]]; }

model_file() {
    case ${LLAMA_MODEL:-f16} in
    f16 | F16) echo "$GGUF_F16" ;;
    q8_0 | Q8_0) echo "$GGUF_Q8_0" ;;
    *) echo "$LLAMA_MODEL" ;;
    esac
}

do_start() {
    local port=$1 gguf
    ensure_models
    gguf=$(model_file)
    [[ -f $gguf ]] || die "no GGUF at $gguf"
    # shellcheck disable=SC2086
    start_bg "$NAME" "$VENV/bin/llama-server" -m "$gguf" --alias "$SERVED_MODEL_NAME" \
        --host 127.0.0.1 --port "$port" -t "${LLAMA_THREADS:-2}" -np "${LLAMA_SLOTS:-32}" \
        -c "${LLAMA_CTX:-65536}" ${LLAMA_SERVER_EXTRA_ARGS:-}
    wait_ready "$NAME" "$port" /health
}

peer_main "$NAME" "$@"
