# syntax=docker/dockerfile:1
# zen-mla on an EPYC node: CPU-only torch (no CUDA in the image), zentorch, the project as a wheel.

FROM python:3.11-slim AS build
# The wheel carries the native kernel (setup.py): g++, and CPU torch to build it against. The
# build runs without isolation, on this torch: an isolated one would fetch PyPI's CUDA build.
# ninja: torch's extension build uses it (without it, a slower path the project does not test).
# g++ unpinned: Debian moves its version with the base image
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && pip install --no-cache-dir build==1.2.2 setuptools==84.2.1 ninja==1.11.1.4 \
    && pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY zen_mla ./zen_mla
COPY service ./service
RUN python -m build --wheel --no-isolation --outdir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# torch from PyTorch's CPU wheel index first (PyPI's default build carries CUDA), then zentorch,
# whose wheels are built per torch minor version, then the project without re-resolving torch.
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu \
    && pip install --no-cache-dir zentorch==2.13.0.2 /wheels/*.whl \
    && rm -rf /wheels \
    && useradd --create-home --uid 10001 zen \
    && install -d -o 10001 -g 10001 -m 0700 /run/zen-mla
# /run/zen-mla holds the region socket (same-host shared memory); a volume mounted there starts
# with this owner and mode
USER 10001
WORKDIR /home/zen
EXPOSE 8000 8001
# slim images have no curl: the CLI checks /health and exits 0 when ready
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["zen-mla", "health", "http://127.0.0.1:8000"]
CMD ["zen-mla", "serve", "--host", "0.0.0.0", "--port", "8000"]
