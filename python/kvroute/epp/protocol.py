"""The Endpoint Picker Protocol's messages over Envoy's external processing (ext_proc) stream.

Sources: the Gateway API Inference Extension (GAIE) proposal
``docs/proposals/004-endpoint-picker-protocol`` (v1.0.0) and Envoy's
``envoy/service/ext_proc/v3/external_processor.proto`` (the ``xds-protos`` package's
generated Python). One ext_proc stream is one HTTP request; Envoy sends a
``ProcessingRequest`` per phase it is configured to send and waits for one
``ProcessingResponse`` to each.

Names used on the wire:

=========================================== =================================================
``x-gateway-destination-endpoint``          request header and ``envoy.lb`` dynamic
                                            metadata the picker sets: ``ip:port`` or
                                            ``ip:port,ip:port,...`` (the first, then retry
                                            fallbacks in order); the same value in both
``envoy.lb.subset_hint`` /                  filter metadata Envoy may send: the only
``x-gateway-destination-endpoint-subset``   endpoints the picker may choose (a list of
                                            ``ip:port`` strings)
``envoy.lb`` /                              filter metadata on the response: the endpoint
``x-gateway-destination-endpoint-served``   that served the request (GAIE-conformant
                                            gateways); plain Envoy gives the attribute
                                            ``upstream.address`` when asked for it in
                                            ``response_attributes``
=========================================== =================================================

Nothing here does I/O. Every builder returns a ``ProcessingResponse``.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

__all__ = [
    "DESTINATION_HEADER", "SUBSET_NAMESPACE", "SUBSET_KEY", "LB_NAMESPACE", "SERVED_KEY",
    "EXT_PROC_FILTER", "pb", "headers_of", "continue_headers", "continue_body",
    "continue_trailers", "route", "immediate_raw", "with_response_headers",
    "subset_hint", "served_endpoint", "status_of",
    "endpoint_of_url",
]

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
#: The key of the attributes Envoy's ext_proc filter sends (``request_attributes`` /
#: ``response_attributes``).
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"

_HEADERS_CONTINUE = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_RESPONSE_HEADERS_CONTINUE = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_BODY_CONTINUE = {"request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
                  "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse())}
_TRAILERS_CONTINUE = {
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse())}


def headers_of(msg: pb.HttpHeaders) -> Dict[str, str]:
    """The header map of a headers message, lower-case names to values (Envoy sends
    ``raw_value`` bytes; ``value`` when an older Envoy sends strings). Bytes that are not
    UTF-8 are replaced. A repeated name keeps its last value, as pseudo-headers and the
    fields kvroute reads are single-valued."""
    out: Dict[str, str] = {}
    for h in msg.headers.headers:
        raw = h.raw_value
        out[h.key.lower()] = raw.decode("utf-8", "replace") if raw else h.value
    return out


def continue_headers(response: bool = False) -> pb.ProcessingResponse:
    """The answer to a request (or response) headers message that changes nothing."""
    return _RESPONSE_HEADERS_CONTINUE if response else _HEADERS_CONTINUE


def continue_body(kind: str) -> pb.ProcessingResponse:
    """The answer to a ``request_body`` / ``response_body`` message that changes nothing."""
    return _BODY_CONTINUE[kind]


def continue_trailers(kind: str) -> pb.ProcessingResponse:
    """The answer to a ``request_trailers`` / ``response_trailers`` message."""
    return _TRAILERS_CONTINUE[kind]


def _mutation(set_headers: Iterable[Tuple[str, str]],
              remove: Sequence[str] = ()) -> pb.HeaderMutation:
    return pb.HeaderMutation(
        set_headers=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
            for k, v in set_headers],
        remove_headers=list(remove))


def route(endpoints: Sequence[str], phase: str, extra_headers: Iterable[Tuple[str, str]] = (),
          remove_headers: Sequence[str] = ()) -> pb.ProcessingResponse:
    """The picker's answer: ``x-gateway-destination-endpoint`` set to the endpoints joined by
    ``,`` as a request header and under ``envoy.lb`` in the dynamic metadata (the same
    value), plus ``extra_headers`` set and ``remove_headers`` removed. ``phase``:
    ``"request_headers"`` (a request without a body) or ``"request_body"``."""
    value = ",".join(endpoints)
    common = pb.CommonResponse(
        header_mutation=_mutation([(DESTINATION_HEADER, value), *extra_headers],
                                  remove_headers))
    md = struct_pb2.Struct()
    md.update({LB_NAMESPACE: {DESTINATION_HEADER: value}})
    if phase == "request_headers":
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                     dynamic_metadata=md)
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                 dynamic_metadata=md)


def with_response_headers(headers: Iterable[Tuple[str, str]]) -> pb.ProcessingResponse:
    """The answer to response headers: continue, adding ``headers`` (none: unchanged)."""
    headers = list(headers)
    if not headers:
        return _RESPONSE_HEADERS_CONTINUE
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=_mutation(headers))))


def immediate_raw(status: int, body: bytes, headers: Iterable[Tuple[str, str]]
                  ) -> pb.ProcessingResponse:
    """An ``ImmediateResponse`` of ``status`` with this body and these headers (a
    `kvroute.epp.picker.Refusal`: the OpenAI-shaped JSON error of
    `kvroute.epp.picker.RequestState.refuse`)."""
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=_mutation(headers), body=body, details=f"kvroute_epp_{status}"))


def _struct_value(s: struct_pb2.Struct, namespace_key: Tuple[str, str]
                  ) -> Optional[struct_pb2.Value]:
    ns, key = namespace_key
    fields = s.fields
    if ns not in fields:
        return None
    inner = fields[ns].struct_value.fields
    return inner[key] if key in inner else None


def subset_hint(req: pb.ProcessingRequest) -> Optional[List[str]]:
    """The endpoints the data plane allows for this request (``envoy.lb.subset_hint`` /
    ``x-gateway-destination-endpoint-subset`` in the request's filter metadata), or None when
    it sent none (then every endpoint of the pool is allowed). An empty list allows none.
    Raises ValueError for a value that is not a list of strings."""
    md = req.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in md:
        return None
    fields = md[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    v = fields[SUBSET_KEY]
    if v.WhichOneof("kind") != "list_value":
        raise ValueError(f"{SUBSET_NAMESPACE}.{SUBSET_KEY} must be a list of ip:port strings")
    out = []
    for item in v.list_value.values:
        if item.WhichOneof("kind") != "string_value":
            raise ValueError(f"{SUBSET_NAMESPACE}.{SUBSET_KEY} must be a list of ip:port "
                             "strings")
        out.append(item.string_value)
    return out


def served_endpoint(req: pb.ProcessingRequest) -> Optional[str]:
    """The endpoint that served the request: ``envoy.lb`` /
    ``x-gateway-destination-endpoint-served`` of the filter metadata, else the
    ``upstream.address`` attribute (plain Envoy with ``response_attributes:
    [upstream.address]``), else None."""
    md = req.metadata_context.filter_metadata
    if LB_NAMESPACE in md:
        fields = md[LB_NAMESPACE].fields
        if SERVED_KEY in fields and fields[SERVED_KEY].string_value:
            return fields[SERVED_KEY].string_value
    attrs = req.attributes
    if EXT_PROC_FILTER in attrs:
        fields = attrs[EXT_PROC_FILTER].fields
        if "upstream.address" in fields and fields["upstream.address"].string_value:
            return fields["upstream.address"].string_value
    return None


def status_of(headers: Mapping[str, str]) -> Optional[int]:
    """The ``:status`` of a response headers map, or None."""
    try:
        return int(headers.get(":status", ""))
    except ValueError:
        return None


def endpoint_of_url(url: str) -> str:
    """The ``ip:port`` (``[v6]:port``) of a worker URL ``http(s)://<ip literal>[:port]``.
    Raises ValueError for a URL whose host is not an IP address (Envoy's
    ``ORIGINAL_DST`` and ``override_host`` take addresses, not names) or that is not
    http(s)."""
    import ipaddress
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"worker URL {url!r}: the endpoint picker answers ip:port, so a "
                         "worker URL must be http://<ip address>:<port>")
    try:
        ip = ipaddress.ip_address(parts.hostname)
    except ValueError:
        raise ValueError(f"worker URL {url!r}: the endpoint picker answers ip:port, and "
                         f"{parts.hostname!r} is not an IP address (give the pod or host "
                         "IP)") from None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
