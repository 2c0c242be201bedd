# specsplit: one image for all three services; the sub-command picks the role
# (`specsplit gateway | verifier | drafter | serve`). Every flag also reads SPECSPLIT_<FLAG> from the
# environment, so compose files and Helm charts configure it without command overrides.
FROM python:3.11-slim

# curl: the gateway's container health check (GET /health).
RUN apt-get update \
 && apt-get install -y --no-install-recommends curl \
 && rm -rf /var/lib/apt/lists/*

# Build from a copy that is removed afterwards: the installed package (with stubs generated at build
# time by setup.py) is the only `services` on the path, whatever the working directory.
COPY pyproject.toml setup.py README.md /src/
COPY proto /src/proto
COPY services /src/services
COPY kernels /src/kernels
# The GPU backend: CuPy with the CUDA runtime, cuBLAS and NVRTC from PyPI (the `ctk` extra), so the image
# needs only the host's NVIDIA driver (the kernels are compiled by NVRTC at first use and cached).
# A CPU-only image: docker build --build-arg SPECSPLIT_GPU= .
ARG SPECSPLIT_GPU="cupy-cuda12x[ctk]>=14"
RUN pip install --no-cache-dir /src aiohttp prometheus-client ${SPECSPLIT_GPU} \
 && rm -rf /src

RUN useradd --create-home --uid 10001 specsplit \
 && mkdir -p /run/specsplit /models /var/cache/specsplit \
 && chown specsplit /run/specsplit /var/cache/specsplit
USER specsplit
WORKDIR /home/specsplit
# The kernels NVRTC builds at start-up (every one a request may launch) are kept here; compose mounts a volume on
# it, so a restarted container reads them back instead of building them again.
ENV PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/var/cache/specsplit/cupy

# 8080 OpenAI HTTP (gateway), 50051 verifier gRPC, 50052 public gateway gRPC, 50053 drafter gRPC
EXPOSE 8080 50051 50052 50053
ENTRYPOINT ["specsplit"]
CMD ["--help"]
