# syntax=docker/dockerfile:1
# Build stage: dependencies are compiled in their own cached layer, then the crate.
FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs* ./
COPY proto ./proto
RUN mkdir src && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && cargo build --release --locked 2>/dev/null || true
COPY src ./src
RUN touch src/main.rs src/lib.rs && cargo build --release --locked --bin llmtap

# Runtime: small, non-root. Inside a container llmtap must listen beyond loopback to be reachable.
FROM debian:bookworm-slim
RUN useradd --system --uid 10001 --home /data llmtap && mkdir -p /data && chown llmtap /data
COPY --from=build /src/target/release/llmtap /usr/local/bin/llmtap
USER llmtap
ENV LLMTAP_DATA_DIR=/data
VOLUME /data
EXPOSE 8787
ENTRYPOINT ["/usr/local/bin/llmtap"]
CMD ["serve", "--listen", "0.0.0.0:8787"]
