# lopa runtime for Huawei Ascend NPUs (HCCL): the image when spec.accelerator.type is ascend.
#
# Note: this image is not built in CI (no NPU, no CANN licence acceptance there). It must start
# FROM a CANN base image whose CANN version matches the torch-npu release below and the driver
# on the nodes (see https://gitee.com/ascend/pytorch for the matrix). The Ascend device plugin
# sets ASCEND_VISIBLE_DEVICES and the Ascend Docker runtime mounts the driver
# (/usr/local/Ascend/driver) into the container; do not bake the driver into the image.
# Ascend 910 servers are aarch64: build with --platform linux/arm64.
#   docker build --platform linux/arm64 -f docker/runtime-ascend.Dockerfile \
#     --build-arg CANN_IMAGE=<registry>/cann:<version>-910b-ubuntu22.04-py3.11 \
#     -t ghcr.io/lopa-dev/lopa:0.1.0-ascend .
# CANN_IMAGE has no default: the CANN version is the node's, and a moving tag would change it.
ARG CANN_IMAGE
FROM ${CANN_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    PIP_NO_CACHE_DIR=1
# torch and torch-npu must be the pair published for the CANN version of the base image.
ARG TORCH_VERSION=2.5.1
ARG TORCH_NPU_VERSION=2.5.1
RUN pip install "torch==${TORCH_VERSION}" "torch-npu==${TORCH_NPU_VERSION}"
WORKDIR /src
COPY requirements/constraints.txt ./requirements/
COPY runtime/ ./runtime/
# Every other dependency at the versions of requirements/lock.txt; torch stays the CANN pair above.
RUN grep -v '^torch==' requirements/constraints.txt > /tmp/constraints.txt \
 && pip install -c /tmp/constraints.txt ./runtime && rm -rf /src /tmp/constraints.txt
# The CANN environment (set_env.sh) is sourced by the base image's entrypoint on most tags;
# lopa imports torch_npu only when the config asks for device npu.
# Non-root, as the operator runs every runtime pod (runAsUser 65532). The NPUs (/dev/davinci*) are
# usually owned by the driver's HwHiAiUser group: give the pods that group (the LoPADeployment's
# spec.podSecurityContext.supplementalGroups), or run them as root where the driver insists
# (docs/guides/security.md, "Pod security").
USER 65532:65532
EXPOSE 50051 50052 29500 9090
ENTRYPOINT ["lopa"]
