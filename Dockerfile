# syntax=docker/dockerfile:1
# Multi-stage: the build stage installs the gateway into a virtual environment and builds the
# embedded model; the runtime stage carries only that environment and the model, runs as a
# non-root user, and lets SIGTERM reach the server (exec-form entrypoint) for a graceful drain.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
RUN pip install ".[openvino]"
# Models baked into the image (space-separated profile names): the embedded default, plus the
# trivial model for measuring the serving path. Add resnet50 (100 MB) if you serve it embedded.
ARG MODELS="efficientnet-lite0 trivial"
RUN for m in $MODELS; do GATEWAY_MODELS_DIR=/opt/models gateway models build --model "$m"; done
# Published checkpoints to fetch (needs internet at build time; SHA-256 checked), e.g.
# `docker compose build --build-arg FETCH=resnet50`: ResNet-50 then has its real ImageNet weights
# for the gateway, the workers and the Triton repository alike (one image, one models directory).
ARG FETCH=""
RUN for m in $FETCH; do GATEWAY_MODELS_DIR=/opt/models gateway models fetch "$m"; done

FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin gateway \
    && mkdir -p /models && chown 10001 /models
COPY --from=build /opt/venv /opt/venv
# Owned by the runtime user: a model not baked in (resnet50 for the Triton repository) is built at start.
COPY --from=build --chown=10001 /opt/models /opt/models
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    GATEWAY_MODELS_DIR=/opt/models \
    GATEWAY_HOST=0.0.0.0 \
    GATEWAY_PORT=8000
USER 10001
WORKDIR /tmp
EXPOSE 8000 9101
# One uvicorn process per container: scale with replicas (the batcher and its metrics are per process).
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2).status != 200)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["gateway"]
CMD ["serve"]
