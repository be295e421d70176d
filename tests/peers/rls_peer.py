"""A client of Envoy's rate limit service protocol, built from Envoy's own
definitions (the xds-protos package's generated stubs), as Envoy's
ratelimit filter calls it.

    rls_peer.py HOST:PORT CALLS_JSON

CALLS_JSON is a list of calls, each {"domain": ..., "hits_addend": n?,
"descriptors": [{"entries": [[key, value], ...], "hits_addend": n?}]}.
Prints one JSON line per call: the overall code, each descriptor's status
(code, remaining, its limit, seconds until reset) and the headers to add;
or the gRPC error's code and message.
"""

import json
import sys

import grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc


def call(stub, spec):
    request = rls_pb2.RateLimitRequest(
        domain=spec["domain"], hits_addend=spec.get("hits_addend", 0)
    )
    for d in spec["descriptors"]:
        descriptor = request.descriptors.add()
        for key, value in d["entries"]:
            entry = descriptor.entries.add()
            entry.key = key
            entry.value = value
        if "hits_addend" in d:
            descriptor.hits_addend.value = d["hits_addend"]
    try:
        response = stub.ShouldRateLimit(request, timeout=30)
    except grpc.RpcError as e:
        return {"error": e.code().name, "message": e.details()}
    codes = rls_pb2.RateLimitResponse.Code
    units = rls_pb2.RateLimitResponse.RateLimit.Unit
    statuses = []
    for s in response.statuses:
        status = {"code": codes.Name(s.code), "remaining": s.limit_remaining}
        if s.HasField("current_limit"):
            status["limit"] = {
                "name": s.current_limit.name,
                "requests_per_unit": s.current_limit.requests_per_unit,
                "unit": units.Name(s.current_limit.unit),
            }
        if s.HasField("duration_until_reset"):
            status["reset_s"] = s.duration_until_reset.ToTimedelta().total_seconds()
        statuses.append(status)
    return {
        "code": codes.Name(response.overall_code),
        "statuses": statuses,
        "headers": {h.key: h.value for h in response.response_headers_to_add},
    }


def main():
    target, calls = sys.argv[1], json.loads(sys.argv[2])
    with grpc.insecure_channel(target) as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        for spec in calls:
            print(json.dumps(call(stub, spec)), flush=True)


if __name__ == "__main__":
    main()
