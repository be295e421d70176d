"""A real gRPC peer (grpcio) for floodgate's tests, with no generated code:
methods take and return raw bytes.

    grpc_peer.py server            serves on a free port, prints it, runs until stdin closes
    grpc_peer.py unary TARGET N    N unary calls of /test.Echo/Say; prints one JSON line each
    grpc_peer.py stream TARGET N   one server-streaming call of /test.Echo/Count for N messages
    grpc_peer.py metered TARGET U… one unary call of /test.Echo/Metered per U

The server answers Say with b"echo:" + the request, and Count with N
messages b"0".."N-1", then trailing metadata x-peer-trailer: done.
Metered answers b"ok" with trailing metadata x-usage-units: the request
(the units a metered API reports it used). Each
printed line is {"code": ..., "details": ..., "messages": [...],
"trailers": {...}, "headers": {...}}.
"""

import json
import sys
from concurrent import futures

import grpc


def serve():
    def say(request, context):
        return b"echo:" + request

    def count(request, context):
        for i in range(int(request.decode())):
            yield str(i).encode()
        context.set_trailing_metadata((("x-peer-trailer", "done"),))

    def metered(request, context):
        context.set_trailing_metadata((("x-usage-units", request.decode()),))
        return b"ok"

    handler = grpc.method_handlers_generic_handler(
        "test.Echo",
        {
            "Metered": grpc.unary_unary_rpc_method_handler(metered),
            "Say": grpc.unary_unary_rpc_method_handler(say),
            "Count": grpc.unary_stream_rpc_method_handler(count),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()
    server.stop(0)


def report(code, details, messages, headers, trailers):
    print(
        json.dumps(
            {
                "code": code.name,
                "details": details,
                "messages": [m.decode() for m in messages],
                "headers": {k: v for k, v in headers or ()},
                "trailers": {k: v for k, v in trailers or ()},
            }
        ),
        flush=True,
    )


def unary(target, n):
    with grpc.insecure_channel(target) as channel:
        say = channel.unary_unary("/test.Echo/Say")
        for i in range(n):
            try:
                reply, call = say.with_call(f"hello {i}".encode(), timeout=10)
                report(call.code(), call.details(), [reply],
                       call.initial_metadata(), call.trailing_metadata())
            except grpc.RpcError as e:
                report(e.code(), e.details(), [],
                       e.initial_metadata(), e.trailing_metadata())


def metered(target, units):
    with grpc.insecure_channel(target) as channel:
        call_metered = channel.unary_unary("/test.Echo/Metered")
        for u in units:
            try:
                reply, call = call_metered.with_call(u.encode(), timeout=30)
                report(call.code(), call.details(), [reply],
                       call.initial_metadata(), call.trailing_metadata())
            except grpc.RpcError as e:
                report(e.code(), e.details(), [],
                       e.initial_metadata(), e.trailing_metadata())


def stream(target, n):
    with grpc.insecure_channel(target) as channel:
        count = channel.unary_stream("/test.Echo/Count")
        call = count(str(n).encode(), timeout=10)
        messages = []
        try:
            for m in call:
                messages.append(m)
        except grpc.RpcError:
            pass
        report(call.code(), call.details(), messages,
               call.initial_metadata(), call.trailing_metadata())


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "server":
        serve()
    elif mode == "unary":
        unary(sys.argv[2], int(sys.argv[3]))
    elif mode == "stream":
        stream(sys.argv[2], int(sys.argv[3]))
    elif mode == "metered":
        metered(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(f"unknown mode {mode}")
