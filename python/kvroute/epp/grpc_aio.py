"""The picker's ext_proc transport in Python (grpcio's asyncio server), for where the native one
(`kvroute.epp.native`, the C++ ``kvroute._epp``) is not built. Same protocol, same answers;
more CPU per request (benchmarks/README.md).

`Servicer.Process` maps Envoy's messages onto a `kvroute.epp.picker.RequestState`: request
headers kept (answered "continue" unless no body follows), the buffered body decided, response
headers and body reported, the end of the stream accounted.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Dict

from kvroute.epp import protocol as P
from kvroute.epp.picker import EndpointPicker
from kvroute.epp.protocol import pb

__all__ = ["Servicer", "serve_grpc_aio"]


class Servicer:
    """``envoy.service.ext_proc.v3.ExternalProcessor`` over a picker."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker

    async def Process(self, requests: AsyncIterator[pb.ProcessingRequest],
                      context: Any) -> AsyncIterator[pb.ProcessingResponse]:
        st = self.picker.state()
        headers: Dict[str, str] = {}
        response_headers: Any = ()
        try:
            async for req in requests:
                kind = req.WhichOneof("request")
                if kind == "request_headers":
                    headers = P.headers_of(req.request_headers)
                    if not req.request_headers.end_of_stream:
                        yield P.continue_headers()
                        continue
                    raw = None
                elif kind == "request_body":
                    if not req.request_body.end_of_stream:
                        yield P.immediate_raw(*st.refuse(
                            500, "the endpoint picker needs the whole request body in one "
                                 "message: configure Envoy's ext_proc request_body_mode: "
                                 "BUFFERED"))
                        return
                    raw = req.request_body.body
                elif kind == "response_headers":
                    h = P.headers_of(req.response_headers)
                    st.response(P.status_of(h), P.served_endpoint(req),
                                h.get("content-type", ""), h.get("endpoint-load-metrics"))
                    yield P.with_response_headers(response_headers)
                    continue
                elif kind == "response_body":
                    st.body(req.response_body.body)
                    yield P.continue_body("response_body")
                    continue
                elif kind in ("request_trailers", "response_trailers"):
                    yield P.continue_trailers(kind)
                    continue
                else:
                    yield P.immediate_raw(*st.refuse(500, "the endpoint picker does not "
                                                          f"handle {kind}"))
                    return
                try:
                    subset = P.subset_hint(req)
                except ValueError:
                    subset = False  # type: ignore[assignment]
                answer = await st.decide(headers, raw, subset)
                if len(answer) == 3:  # a refusal
                    status, body, hs = answer
                    yield P.immediate_raw(status, body, hs)
                    return
                endpoints, extra, remove, response_headers, _ = answer
                yield P.route(endpoints.split(","), kind, extra, remove)
        finally:
            st.account()


async def serve_grpc_aio(picker: EndpointPicker, address: str, max_message_bytes: int
                         ) -> Any:
    """Starts a grpcio asyncio server on ``address`` with the ext_proc servicer and the health
    service; returns (server, port, set_serving(service, bool) coroutine function)."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pbg
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1.health import aio as health_aio

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes),
                                      ("grpc.max_send_message_length", max_message_bytes),
                                      ("grpc.so_reuseport", 0)])
    pbg.add_ExternalProcessorServicer_to_server(Servicer(picker), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address} (gRPC)")
    await server.start()

    async def set_serving(service: str, serving: bool) -> None:
        await health.set(service, health_pb2.HealthCheckResponse.SERVING if serving
                         else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(grace_s: float) -> None:
        await health.enter_graceful_shutdown()
        await server.stop(grace=grace_s)

    return port, set_serving, stop
