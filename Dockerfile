# rnnserve on the CPU: `docker build -t rnnserve .` then `docker run -p 127.0.0.1:8000:8000 rnnserve` serves the
# embedded default model; flags after the image name go to `rnnserve serve` (`--model /models/x --max-num-seqs 32`).
# The CUDA image is Dockerfile.cuda. docs/deploy.md has Compose and Kubernetes.
FROM python:3.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TORCH_EXTENSIONS_DIR=/opt/rnnserve/torch_extensions

# g++ builds the fused CPU kernels below; PyTorch's extension loader checks the compiler again at each start.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 rnnserve \
    && useradd --create-home --uid 10001 --gid 10001 rnnserve

# The CPU build of torch from its own index (PyPI's default torch is a multi-GB CUDA build).
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /opt/rnnserve/src
COPY pyproject.toml README.md ./
COPY rnnserve ./rnnserve
COPY engine ./engine
COPY kernels ./kernels
COPY server ./server
COPY clients ./clients
RUN pip install . "torch==${TORCH_VERSION}"

# Compile the C++ CPU kernels now, as the user that serves, so a container starts ready on CPUs of the build
# machine's kind (they are compiled for its instruction set); on another kind the server compiles its own at
# start (a minute or two, within the startup probe's five).
# /var/lib/rnnserve/sessions: where Compose and Kubernetes mount a volume for --session-dir (a new named volume
# takes the owner of the image's folder).
RUN mkdir -p "${TORCH_EXTENSIONS_DIR}" /var/lib/rnnserve/sessions \
    && chown 10001:10001 "${TORCH_EXTENSIONS_DIR}" /var/lib/rnnserve/sessions
USER 10001:10001
WORKDIR /home/rnnserve
RUN python -c "from rnnserve.kernels.cpu_extension import build_cpu_extension; assert build_cpu_extension()"

EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["rnnserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
