# lopa-operator image: Python slim + the operator package only (kopf, kubernetes client; no torch).
# Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/lopa-dev/lopa-operator:0.1.0 .
FROM python:3.11.14-slim-bookworm AS build
WORKDIR /src
COPY requirements/constraints.txt ./requirements/
COPY operator/ ./operator/
# The dependencies at the versions of requirements/lock.txt (its constraints: no hashes for a directory).
RUN pip install --no-cache-dir --prefix=/install -c requirements/constraints.txt ./operator

FROM python:3.11.14-slim-bookworm
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY --from=build /install /usr/local
# Fail the build if torch ever sneaks into the operator's dependency tree.
RUN python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)" \
 && python -c "import lopa_operator.handlers"
# Non-root, matching the chart's podSecurityContext (readOnlyRootFilesystem friendly).
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["lopa-operator"]
CMD ["--all-namespaces"]
