# DiLoCoX image: one image for shards and sites (`dilocox server` / `dilocox worker`).
#
#   docker build -t dilocox:cpu .                              # with a registry: python:3.11-slim, CPU torch
#   docker build -t dilocox:cuda --build-arg BASE_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu24.04 \
#                --build-arg TORCH_INDEX_URL= .                 # CUDA variant: PyPI's (CUDA) torch
#   dilocox compose build                                       # offline: local debootstrap base + host wheelhouse
#
# WHEELHOUSE names a folder of wheels inside the build context (made on the host by `dilocox compose
# build`): when set, everything is installed from it with --no-index, so the build needs no network.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
# Lets `dilocox compose build` prune exactly its own dangling images (old builds of either stage).
LABEL org.dilocox.stage=build
ARG WHEELHOUSE=""
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Ubuntu-based CUDA images lack venv/pip; Debian minbase (offline base) and python:*-slim have them.
RUN python3 -m venv /opt/dilocox 2>/dev/null || { apt-get update && apt-get install -y --no-install-recommends \
      python3 python3-venv iproute2 && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/dilocox; }
COPY . /src
RUN set -eux; cd /src; \
    if [ -n "$WHEELHOUSE" ]; then \
      /opt/dilocox/bin/pip install --no-cache-dir --no-index --find-links "/src/$WHEELHOUSE" dilocox; \
    elif [ -n "$TORCH_INDEX_URL" ]; then \
      /opt/dilocox/bin/pip install --no-cache-dir --extra-index-url "$TORCH_INDEX_URL" /src; \
    else \
      /opt/dilocox/bin/pip install --no-cache-dir /src; \
    fi

# The runtime stage gets the virtualenv only: no sources, no wheelhouse.
FROM ${BASE_IMAGE} AS runtime
LABEL org.dilocox.stage=runtime
RUN command -v tc >/dev/null 2>&1 || { apt-get update && apt-get install -y --no-install-recommends iproute2 \
      && rm -rf /var/lib/apt/lists/*; } || true
RUN command -v python3 >/dev/null 2>&1 || { apt-get update && apt-get install -y --no-install-recommends python3 \
      && rm -rf /var/lib/apt/lists/*; }
COPY --from=build /opt/dilocox /opt/dilocox
ENV PATH=/opt/dilocox/bin:$PATH PYTHONUNBUFFERED=1
EXPOSE 50051 9100
ENTRYPOINT []
CMD ["dilocox", "--help"]
