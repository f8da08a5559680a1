"""The peers of ``bench.peers``: this project's own ``Assembler`` served the way a user would serve
it without this stack, one process per ``python -m bench.peer_servers grpc|http PORT NAME`` (run two).

* ``grpc``: grpc.aio on the default asyncio loop (grpc's own poller), a generic unary handler on raw
  bytes (``/ibex.Context/Assemble`` and ``/ibex.Context/Transport``), ``grpc.so_reuseport`` so two
  processes share the port and the kernel spreads connections over them.
* ``http``: Starlette under uvicorn on uvloop with the httptools parser, access log off, one socket
  bound with SO_REUSEPORT per process (uvicorn's own ``--workers`` shares one socket through a
  supervisor; SO_REUSEPORT is what ``gunicorn --reuse-port`` gives and spreads connections the same
  way). Routes ``POST /assemble`` and ``POST /transport``.

Both speak this project's msgpack request and reply (``shared.wire.codec``) so the pipeline, the payload
and the reply are the same bytes as through the broker; only the serving differs. A request is
decoded and validated once, its epoch deadline converted once to local monotonic time, and the
reply is an ``AssembleResponse`` or an ``ErrorReply`` (DEADLINE_EXCEEDED once the deadline has
passed, exactly like the worker). ``Transport`` answers the canned minimal response without
decoding, like the transport-mode worker (``bench.lib.transport``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import socket
import sys
import time
from typing import Any

from bench.lib.transport import transport_response
from ibex_context.shared.config.settings import Settings
from ibex_context.shared.wire.codec import decode_request, encode, encode_document, encode_error, scan_request_id
from ibex_context.shared.wire.errors import DeadlineExceeded, IbexError, Internal
from ibex_context.shared.wire.models import ErrorReply
from ibex_context.worker.assemble import Assembler

READY_LINE = "peer serving"


class Service:
    """The whole application both peers serve: bytes in, bytes out."""

    def __init__(self, assembler: Assembler, settings: Settings, name: str) -> None:
        self.assembler = assembler
        self.settings = settings
        self.name = name
        self._template = {**transport_response("-", {}).model_dump(mode="python"), "worker_id": name}

    async def assemble(self, payload: bytes) -> bytes:
        req = decode_request(payload, max_bytes=self.settings.max_request_bytes)
        if isinstance(req, ErrorReply):
            return encode(req)
        remaining = req.deadline_ns - time.time_ns()  # epoch -> monotonic, once, on receipt
        now = time.monotonic_ns()
        try:
            if remaining <= 0:
                raise DeadlineExceeded("deadline passed before the server could start")
            resp = await self.assembler.assemble(req, deadline_mono_ns=now + remaining)
            if time.monotonic_ns() >= now + remaining:
                raise DeadlineExceeded("assembly finished after the deadline")
            return encode(resp)
        except IbexError as exc:
            return encode_error(exc, req.request_id)
        except Exception as exc:  # a bug must still answer, as the worker does
            return encode_error(Internal(f"internal error: {type(exc).__name__}"), req.request_id)

    def transport(self, payload: bytes) -> bytes:
        rid = scan_request_id(payload) or "-"
        return encode_document({**self._template, "request_id": rid}, rid)


async def build_service(name: str) -> Service:
    """The worker's own start-up (``ibex_context.worker.__main__.serve``) without its sockets."""
    from ibex_context.pipeline.budget.catalog import Catalog
    from ibex_context.worker.retrieve import Retriever

    settings = Settings()
    if settings.redis_url is None:
        raise SystemExit("IBEX_REDIS_URL is not set")
    retriever = Retriever.create(settings, settings.redis_url)
    catalog = Catalog.load(settings.catalog_path, cache_entries=settings.token_cache_entries)
    catalog.warm_up()
    await retriever.warm_up()
    gc.collect()
    gc.freeze()  # as the worker does: long-lived tables out of every later collection
    return Service(Assembler(settings=settings, catalog=catalog, retriever=retriever, worker_id=name), settings, name)


# ------------------------------------------------------------------------------------------ gRPC


async def serve_grpc(port: int, name: str) -> None:
    import grpc

    service = await build_service(name)

    async def assemble(payload: bytes, _ctx: Any) -> bytes:
        return await service.assemble(payload)

    async def transport(payload: bytes, _ctx: Any) -> bytes:
        return service.transport(payload)

    handler = grpc.method_handlers_generic_handler("ibex.Context", {
        "Assemble": grpc.unary_unary_rpc_method_handler(assemble),
        "Transport": grpc.unary_unary_rpc_method_handler(transport)})
    server = grpc.aio.server(options=[("grpc.so_reuseport", 1),
                                      ("grpc.max_receive_message_length", 4 << 20)])
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(READY_LINE, file=sys.stderr, flush=True)
    await server.wait_for_termination()


# ------------------------------------------------------------------------------------------ HTTP


def reuseport_socket(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    s.listen(2048)
    s.setblocking(False)
    return s


async def serve_http(port: int, name: str) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    service = await build_service(name)

    async def assemble(request: Request) -> Response:
        return Response(await service.assemble(await request.body()), media_type="application/msgpack")

    async def transport(request: Request) -> Response:
        return Response(service.transport(await request.body()), media_type="application/msgpack")

    app = Starlette(routes=[Route("/assemble", assemble, methods=["POST"]),
                            Route("/transport", transport, methods=["POST"])])
    config = uvicorn.Config(app, http="httptools", loop="uvloop", access_log=False, log_level="warning",
                            lifespan="off")
    sock = reuseport_socket(port)  # listening from here: connections wait in the backlog until serve()
    print(READY_LINE, file=sys.stderr, flush=True)
    await uvicorn.Server(config).serve(sockets=[sock])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.peer_servers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["grpc", "http"])
    ap.add_argument("port", type=int)
    ap.add_argument("name")
    args = ap.parse_args(argv)
    print(f"peer {args.kind} {args.name} pid {os.getpid()} port {args.port}", file=sys.stderr, flush=True)
    if args.kind == "grpc":
        asyncio.run(serve_grpc(args.port, args.name))
    else:
        import uvloop

        uvloop.run(serve_http(args.port, args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
