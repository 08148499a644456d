# lopa runtime for NVIDIA GPUs (NCCL): the image when spec.accelerator.type is nvidia.
# The CUDA user-space libraries come with the torch wheels; the driver comes from the node
# through the NVIDIA container toolkit (the device plugin allocates nvidia.com/gpu).
#   docker build -f docker/runtime-cuda.Dockerfile -t ghcr.io/lopa-dev/lopa:0.1.0-cuda .
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    PIP_NO_CACHE_DIR=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN pip install --index-url https://download.pytorch.org/whl/cu124 "torch>=2.5"
WORKDIR /src
COPY runtime/ ./runtime/
RUN pip install ./runtime && rm -rf /src
USER 65532:65532
EXPOSE 50051 50052 29500 9090
ENTRYPOINT ["lopa"]
