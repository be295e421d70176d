# floodgate container image.
#
# Base images are pinned to a version (pass --build-arg to move them; pin by
# digest, e.g. rust:1.95.0-bookworm@sha256:..., for builds that must be
# reproducible byte for byte).
ARG RUST_IMAGE=rust:1.95.0-bookworm
ARG DEBIAN_IMAGE=debian:12.11-slim

# Build stage: the same command the README gives for a release build.
FROM ${RUST_IMAGE} AS build
WORKDIR /src
# Dependencies first, in a layer of their own: built from the manifest and
# the lock file with stand-in sources, so a change to floodgate's code (or to
# anything else in the tree) rebuilds floodgate alone, not every crate.
COPY Cargo.toml Cargo.lock ./
RUN mkdir -p src benches \
 && echo 'fn main() {}' > src/main.rs \
 && touch src/lib.rs \
 && for bench in $(awk -F'"' '/^\[\[bench\]\]/ {b = 1; next} /^\[/ {b = 0} b && /^name/ {print $2}' Cargo.toml); do echo 'fn main() {}' > "benches/$bench.rs"; done \
 && cargo build --release --locked \
 && rm -rf src benches
COPY src src
COPY lua lua
COPY benches benches
# The sources keep the times they had in the build context, older than the
# stand-ins' build: touch them so cargo sees that they changed.
RUN find src lua benches -type f -exec touch {} + \
 && cargo build --release --locked

# Runtime: a small Debian base, running as an unprivileged user and group,
# with the CA bundle that rediss:// and https:// upstreams verify public
# certificates against.
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 floodgate \
 && useradd --uid 10001 --gid floodgate --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin floodgate
COPY --from=build /src/target/release/floodgate /usr/local/bin/floodgate
COPY config/container.toml /etc/floodgate/floodgate.toml
ENV FLOODGATE_CONFIG=/etc/floodgate/floodgate.toml
USER 10001:10001
EXPOSE 8080
STOPSIGNAL SIGTERM
# --probe without a URL reads FLOODGATE_CONFIG: /healthz on whatever admin
# listener the mounted file names (or a connection to its proxy listener
# when it has none), so any configuration gets an honest health state.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["/usr/local/bin/floodgate", "--probe"]
ENTRYPOINT ["/usr/local/bin/floodgate"]
