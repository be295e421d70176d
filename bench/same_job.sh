# nginx and HAProxy doing floodgate's job as operators run them for a
# rate-limited API, for bench/run.sh and bench/callgrind.sh (sourced): a
# per-address limit that never triggers, the client's Host passed on and the
# upstream told who asked (X-Forwarded-For, -Proto, -Host), as floodgate does
# by default; upstream connections kept alive.

# nginx's `location` for it (the `http` block needs `upstream app` and
# `limit_req_zone ... zone=perip`, which same_job_nginx_http writes).
same_job_nginx_location() {
  cat <<'CONF'
    location / { limit_req zone=perip burst=1000000 nodelay;
      proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_set_header Host $host;
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Proto $scheme;
      proxy_set_header X-Forwarded-Host $host; }
CONF
}

# The lines of nginx's `http` block that the location needs: upstream
# port $1, $2 idle connections kept.
same_job_nginx_http() {
  cat <<CONF
  upstream app { server 127.0.0.1:$1; keepalive $2; keepalive_requests 1000000; }
  limit_req_zone \$binary_remote_addr zone=perip:10m rate=100000000r/s;
CONF
}

# HAProxy's whole configuration for it: listening on port $1, the
# upstream on port $2, one thread.
same_job_haproxy() {
  cat <<CONF
global
  nbthread 1
defaults
  mode http
  timeout connect 5s
  timeout client 30s
  timeout server 30s
  http-reuse always
frontend fe
  bind 127.0.0.1:$1
  stick-table type ip size 1m expire 10s store http_req_rate(10s)
  http-request track-sc0 src
  http-request deny deny_status 429 if { sc_http_req_rate(0) gt 100000000 }
  option forwardfor
  http-request set-header X-Forwarded-Proto http
  http-request set-header X-Forwarded-Host %[req.hdr(host)]
  default_backend app
backend app
  server up 127.0.0.1:$2
CONF
}
