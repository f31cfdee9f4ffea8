"""What the gRPC server's bridge into trio costs: grpcio's asyncio server on
its own thread calling trio through ``rpc/portal.py`` (what trioserve uses),
against purerpc, which runs on trio itself (through anyio).

Both serve the same two methods over loopback, with no engine behind them:
a unary echo whose answer is made in trio, and a server stream of small
messages made in trio. One grpcio client (the kind a service in another
language would bring) measures unary latency (sequential calls) and stream
throughput.

purerpc pins h2 < 4 while hypercorn runs on h2 4, so it is not installed in
trioserve's environment; run this in a throwaway one for the comparison::

    python -m venv /tmp/purerpc-venv
    /tmp/purerpc-venv/bin/pip install purerpc trio attrs grpcio
    /tmp/purerpc-venv/bin/python scripts/bench_grpc_bridge.py

In trioserve's own environment it measures the grpcio bridge only.
"""


import argparse
import asyncio
import importlib.util
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc
import trio
from google.protobuf.wrappers_pb2 import StringValue

SERVICE = "bench.Echo"


def _load_portal():
    # rpc/portal.py by path: the throwaway environment has no trioserve.
    path = Path(__file__).resolve().parent.parent / "rpc" / "portal.py"
    spec = importlib.util.spec_from_file_location("portal", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def echo_in_trio(text: str) -> str:
    await trio.lowlevel.checkpoint()
    return text


async def produce_in_trio(emit, count: int) -> None:
    for i in range(count):
        await emit(str(i))


# -- servers, each on its own thread with a trio loop ---------------------------


def grpcio_bridged_server(ready: list) -> None:
    portal_module = _load_portal()

    async def main() -> None:
        token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            portal = portal_module.TrioPortal(token, nursery)
            started = trio.Event()

            async def serve() -> None:
                async def unary(request, context):
                    return StringValue(value=await portal.run(echo_in_trio, request.value))

                async def stream(request, context):
                    async for item in portal.iterate(produce_in_trio, int(request.value)):
                        yield StringValue(value=item)

                handlers = grpc.method_handlers_generic_handler(
                    SERVICE,
                    {
                        "Unary": grpc.unary_unary_rpc_method_handler(
                            unary, StringValue.FromString, StringValue.SerializeToString
                        ),
                        "Stream": grpc.unary_stream_rpc_method_handler(
                            stream, StringValue.FromString, StringValue.SerializeToString
                        ),
                    },
                )
                server = grpc.aio.server()
                server.add_generic_rpc_handlers((handlers,))
                port = server.add_insecure_port("127.0.0.1:0")
                await server.start()
                ready.append(port)
                token.run_sync_soon(started.set)
                await server.wait_for_termination()

            threading.Thread(target=asyncio.run, args=(serve(),), daemon=True).start()
            await started.wait()
            await trio.sleep_forever()

    trio.run(main)


def purerpc_server(ready: list) -> None:
    import purerpc

    service = purerpc.Service(SERVICE)

    @service.rpc("Unary")
    async def unary(message: StringValue) -> StringValue:
        return StringValue(value=await echo_in_trio(message.value))

    @service.rpc("Stream")
    async def stream(message: StringValue) -> purerpc.Stream[StringValue]:
        for i in range(int(message.value)):
            yield StringValue(value=str(i))

    server = purerpc.Server(port=0)
    server.add_service(service)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ready.append(await nursery.start(server.serve_async))

    trio.run(main)


def measure(port: int, calls: int, stream_items: int, streams: int) -> dict[str, float]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary = channel.unary_unary(
            f"/{SERVICE}/Unary", request_serializer=StringValue.SerializeToString, response_deserializer=StringValue.FromString
        )
        stream = channel.unary_stream(
            f"/{SERVICE}/Stream", request_serializer=StringValue.SerializeToString, response_deserializer=StringValue.FromString
        )
        for _ in range(50):  # warm up
            unary(StringValue(value="x"))
        latencies = []
        for _ in range(calls):
            start = time.perf_counter()
            unary(StringValue(value="hello"))
            latencies.append(time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(streams):
            assert sum(1 for _ in stream(StringValue(value=str(stream_items)))) == stream_items
        seconds = time.perf_counter() - start
    latencies.sort()
    return {
        "unary_p50_us": statistics.median(latencies) * 1e6,
        "unary_p99_us": latencies[int(len(latencies) * 0.99)] * 1e6,
        "stream_msgs_per_s": streams * stream_items / seconds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--stream-items", type=int, default=2000)
    parser.add_argument("--streams", type=int, default=5)
    args = parser.parse_args()
    servers = [("grpcio + trio portal", grpcio_bridged_server)]
    if importlib.util.find_spec("purerpc") is not None:
        servers.append(("purerpc on trio", purerpc_server))
    else:
        print("purerpc is not installed: measuring the grpcio bridge only", file=sys.stderr)
    for name, server in servers:
        ready: list[int] = []
        threading.Thread(target=server, args=(ready,), daemon=True).start()
        while not ready:
            time.sleep(0.01)
        figures = measure(ready[0], args.calls, args.stream_items, args.streams)
        print(f"{name:24s} " + "  ".join(f"{k} {v:,.0f}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
