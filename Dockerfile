# floodgate container image.
#
# Build stage: the same command the README gives for a release build.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked

# Runtime: a small Debian base, running as an unprivileged user.
FROM debian:bookworm-slim
RUN useradd --system --uid 10001 --no-create-home floodgate
COPY --from=build /src/target/release/floodgate /usr/local/bin/floodgate
COPY config/container.toml /etc/floodgate/floodgate.toml
ENV FLOODGATE_CONFIG=/etc/floodgate/floodgate.toml
USER 10001
EXPOSE 8080
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/floodgate"]
