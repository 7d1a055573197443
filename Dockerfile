# DiLoCoX image: one image for shards and sites (`dilocox server` / `dilocox worker`).
#
#   docker build -t dilocox:cpu .                              # with a registry: python:3.11-slim, CPU torch
#   dilocox compose build --variant cuda --print               # the CUDA variant's `docker build` command
#   dilocox compose build                                       # offline: local debootstrap base + host wheelhouse
#
# One recipe, chosen by build arguments (docs/deploy.md, "Image variants"):
#   BASE_IMAGE       python:3.11-slim (CPU), nvidia/cuda:*-runtime-ubuntu24.04 (CUDA), or the offline base
#   TORCH_INDEX_URL  the index torch comes from (PyTorch's cpu or cuXYZ index; empty: PyPI's torch)
#   TORCH_VERSION    pins torch (e.g. 2.13.0, the version CI tests); empty: the newest the index has
#   EXTRAS           dilocox's extras: models (transformers, tokenizers, accelerate: --model llama-*, bpe
#                    tokenizers) and tracking (TensorBoard) by default; add data (pyarrow, ~55 MB of wheel)
#                    where sites read .parquet at start-up. Shards import none of them.
# WHEELHOUSE names a folder of wheels inside the build context (made on the host by `dilocox compose
# build`): when set, everything is installed from it with --no-index, so the build needs no network.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
# Lets `dilocox compose build` prune exactly its own dangling images (old builds of either stage).
LABEL org.dilocox.stage=build
ARG WHEELHOUSE=""
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=""
ARG EXTRAS="models,tracking"
# Ubuntu-based CUDA images lack venv/pip; Debian minbase (offline base) and python:*-slim have them.
RUN python3 -m venv /opt/dilocox 2>/dev/null || { apt-get update && apt-get install -y --no-install-recommends \
      python3 python3-venv iproute2 && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/dilocox; }
COPY . /src
# torch first, from its own index (--index-url: PyPI's build of the same version cannot win), then the
# project with its extras, which finds that torch already installed.
RUN set -eux; cd /src; pip=/opt/dilocox/bin/pip; \
    if [ -n "$WHEELHOUSE" ]; then \
      $pip install --no-cache-dir --no-index --find-links "/src/$WHEELHOUSE" "dilocox${EXTRAS:+[$EXTRAS]}"; \
    else \
      if [ -n "$TORCH_INDEX_URL" ]; then \
        $pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "torch${TORCH_VERSION:+==$TORCH_VERSION}"; \
      elif [ -n "$TORCH_VERSION" ]; then \
        $pip install --no-cache-dir "torch==$TORCH_VERSION"; \
      fi; \
      $pip install --no-cache-dir "/src${EXTRAS:+[$EXTRAS]}"; \
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
