# lopa runtime for NVIDIA GPUs (NCCL): the image when spec.accelerator.type is nvidia.
# The CUDA user-space libraries come with PyPI's torch wheels (CUDA 13: a node driver >= 580); the
# driver comes from the node through the NVIDIA container toolkit (the device plugin allocates
# nvidia.com/gpu).
#   docker build -f docker/runtime-cuda.Dockerfile -t ghcr.io/lopa-dev/lopa:0.1.0-cuda .
FROM python:3.11.14-slim-bookworm
ENV PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    PIP_NO_CACHE_DIR=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /src
COPY requirements/constraints.txt ./requirements/
COPY runtime/ ./runtime/
# torch, its CUDA libraries and every other dependency at the versions of requirements/lock.txt.
RUN pip install -c requirements/constraints.txt ./runtime && rm -rf /src
USER 65532:65532
EXPOSE 50051 50052 29500 9090
ENTRYPOINT ["lopa"]
