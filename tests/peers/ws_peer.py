"""A real WebSocket peer (the `websockets` library) for floodgate's tests.

    ws_peer.py server              echo server on a free port; prints it; runs until stdin closes
    ws_peer.py echo URL N          connects, sends N messages, prints one JSON line:
                                   {"status": 101, "echoes": [...]} or {"status": 429, ...}
    ws_peer.py silent URL SECONDS  connects, sends nothing, prints how long until the
                                   connection was closed ({"closed_after": s} or {"open": true})
"""

import asyncio
import json
import logging
import sys
import time

import websockets


async def serve():
    # A tunnel floodgate closes for idling is expected; its traceback is noise.
    logging.getLogger("websockets").setLevel(logging.CRITICAL)
    async def echo(ws):
        async for message in ws:
            await ws.send(message)

    async with websockets.serve(echo, "127.0.0.1", 0, ping_interval=None) as server:
        port = server.sockets[0].getsockname()[1]
        print(port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def echo(url, n):
    try:
        async with websockets.connect(url, ping_interval=None, open_timeout=10) as ws:
            echoes = []
            for i in range(n):
                await ws.send(f"message {i}")
                echoes.append(await asyncio.wait_for(ws.recv(), 10))
            print(json.dumps({"status": 101, "echoes": echoes}), flush=True)
    except websockets.exceptions.InvalidStatus as e:
        print(json.dumps({"status": e.response.status_code,
                          "body": e.response.body.decode(errors="replace")}), flush=True)


async def silent(url, seconds):
    async with websockets.connect(url, ping_interval=None, open_timeout=10) as ws:
        started = time.monotonic()
        try:
            await asyncio.wait_for(ws.wait_closed(), seconds)
            print(json.dumps({"closed_after": time.monotonic() - started}), flush=True)
        except asyncio.TimeoutError:
            print(json.dumps({"open": True}), flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "server":
        asyncio.run(serve())
    elif mode == "echo":
        asyncio.run(echo(sys.argv[2], int(sys.argv[3])))
    elif mode == "silent":
        asyncio.run(silent(sys.argv[2], float(sys.argv[3])))
    else:
        sys.exit(f"unknown mode {mode}")
