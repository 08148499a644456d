# lopa runtime for CPU (gloo): the image of `lopa master` / `lopa worker` when
# spec.accelerator.type is cpu. Carries the bundled model, so no model volume is needed.
#   docker build -f docker/runtime-cpu.Dockerfile -t ghcr.io/lopa-dev/lopa:0.1.0-cpu .
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    PIP_NO_CACHE_DIR=1
# CPU wheels of torch keep the image ~1 GB instead of ~5 GB with CUDA libraries.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.5"
WORKDIR /src
COPY runtime/ ./runtime/
RUN pip install ./runtime && rm -rf /src
USER 65532:65532
# 50051 client gRPC (master), 50052 worker gRPC, 29500 rendezvous (rank 0), 9090 metrics.
EXPOSE 50051 50052 29500 9090
ENTRYPOINT ["lopa"]
