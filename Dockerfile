# servelm: the OpenAI-compatible server with its bundled models.
#
#   docker build -t servelm .                                  # CPU image
#   docker build -t servelm:cuda --build-arg TORCH_VARIANT=cu128 .   # CUDA image
#   docker run -p 8000:8000 servelm
#
# The image is set up by `make setup`, as CI and developers set up theirs:
# only torch is installed first, from PyTorch's index for TORCH_VARIANT (cpu,
# or a CUDA build such as cu128), at the version the Makefile pins; `make
# setup` then finds it and installs servelm and the model packages exactly
# as it does everywhere else. tests/test_docker.py keeps these steps in step
# with the Makefile. See docs/DEPLOY.md.

FROM python:3.11-slim

# cpu, or a CUDA variant published on https://download.pytorch.org/whl/ for
# the pinned torch version (e.g. cu126, cu128). The CUDA wheels bring their
# own CUDA libraries; the host needs only the NVIDIA driver and container toolkit.
ARG TORCH_VARIANT=cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    INSTALL_BROWSER=0

# gcc and g++ build servelm's CPU kernels and their PyTorch ops on first start,
# for the host's CPU (servelm/kernels); without them the server runs, with
# slower CPU decoding.
RUN apt-get update \
    && apt-get install -y --no-install-recommends make gcc g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app

# torch first, in its own layer: the largest download changes only when the
# Makefile's TORCH_VERSION (or the variant) does.
COPY Makefile ./
RUN TORCH_VERSION="$(sed -n 's/^TORCH_VERSION := *//p' Makefile)" \
    && test -n "$TORCH_VERSION" \
    && python -m venv .venv \
    && .venv/bin/python -m pip install -q "torch==${TORCH_VERSION}" \
        --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"

COPY pyproject.toml README.md ./
COPY servelm ./servelm
RUN make setup

COPY servelm.yaml ./

RUN useradd --create-home --uid 10001 servelm
USER servelm
ENV PATH="/app/.venv/bin:${PATH}"

EXPOSE 8000
# 503 while the models load (start-period covers it) or if the engine died.
# SERVELM_PORT, when set, moves the health check along with the server.
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:${SERVELM_PORT:-8000}/health', timeout=4)" || exit 1

ENTRYPOINT ["servelm"]
CMD ["serve", "--host", "0.0.0.0"]
