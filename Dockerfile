# floodgate container image.
#
# Build stage: the same command the README gives for a release build.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked

# Runtime: a small Debian base, running as an unprivileged user, with the
# CA bundle that rediss:// and https:// upstreams verify public
# certificates against.
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home floodgate
COPY --from=build /src/target/release/floodgate /usr/local/bin/floodgate
COPY config/container.toml /etc/floodgate/floodgate.toml
ENV FLOODGATE_CONFIG=/etc/floodgate/floodgate.toml
USER 10001
EXPOSE 8080
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["/usr/local/bin/floodgate", "--probe", "http://127.0.0.1:9901/healthz"]
ENTRYPOINT ["/usr/local/bin/floodgate"]
