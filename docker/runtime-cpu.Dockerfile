# lopa runtime for CPU (gloo): the image of `lopa master` / `lopa worker` when
# spec.accelerator.type is cpu. Carries the bundled model, so no model volume is needed.
#   docker build -f docker/runtime-cpu.Dockerfile -t ghcr.io/lopa-dev/lopa:0.1.0-cpu .
FROM python:3.11.14-slim-bookworm
ENV PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    PIP_NO_CACHE_DIR=1
# CPU wheels of torch keep the image ~1 GB instead of ~5 GB with CUDA libraries; the version is the
# lock's (tests/operator/test_dockerfiles.py checks it), the rest at requirements/constraints.txt.
ARG TORCH_VERSION=2.15.0
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"
WORKDIR /src
COPY requirements/constraints.txt ./requirements/
COPY runtime/ ./runtime/
RUN pip install -c requirements/constraints.txt ./runtime && rm -rf /src
USER 65532:65532
# 50051 client gRPC (master), 50052 worker gRPC, 29500 rendezvous (rank 0), 9090 metrics.
EXPOSE 50051 50052 29500 9090
ENTRYPOINT ["lopa"]
