# syntax=docker/dockerfile:1
# The kvsvc server image, CPU (default) or CUDA, from this checkout:
#   docker build -t kvsvc:cpu .
#   docker build -t kvsvc:cuda --build-arg VARIANT=cuda .
# The image runs `kvsvc serve --config /etc/kvsvc/kvsvc.toml` as an unprivileged user;
# docs/DEPLOY.md has the flags, mounts and Kubernetes manifests around it.
ARG VARIANT=cpu

# CPU: Debian's Python 3.11 and torch's CPU wheels (NIXL depends on torch; the default
# wheel on PyPI is the multi-GB CUDA build).
FROM python:3.11-slim-bookworm AS base-cpu
ENV KVSVC_TORCH_INDEX=https://download.pytorch.org/whl/cpu

# CUDA: NVIDIA's runtime image; torch's CUDA 12.8 wheels match its driver API.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS base-cuda
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*
ENV KVSVC_TORCH_INDEX=https://download.pytorch.org/whl/cu128

FROM base-${VARIANT}
ARG TORCH_VERSION=2.13.0
RUN python3 -m venv /opt/kvsvc
ENV PATH=/opt/kvsvc/bin:$PATH \
    PYTHONUNBUFFERED=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvsvc ./kvsvc
RUN pip install --no-cache-dir --index-url "$KVSVC_TORCH_INDEX" "torch==${TORCH_VERSION}" \
 && pip install --no-cache-dir ".[server]" \
 && rm -rf /src
WORKDIR /
# One user, no shell tricks: the pools live in /dev/shm (DRAM) or on the GPU (VRAM).
RUN useradd --system --uid 10001 --no-create-home kvsvc
USER 10001
# gRPC (control plane), Prometheus metrics.
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=3s CMD ["kvsvc", "health", "127.0.0.1:50051"]
ENTRYPOINT ["kvsvc"]
CMD ["serve", "--config", "/etc/kvsvc/kvsvc.toml"]
