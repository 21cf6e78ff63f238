"""What every serving front shares: header names, paths, OpenAI-shaped errors, decision JSON.

One definition each, imported by the request pipeline's stages (`kvroute.serving.pipeline`),
the fronts (`kvroute.serving.proxy`, `kvroute.serving.pd`) and the route table
(`kvroute.serving.app`). Nothing here does I/O.

Errors have vLLM's OpenAI-server shape (its ``ErrorResponse`` / ``ErrorInfo``):
``{"error": {"message", "type", "param", "code"}}`` with ``code`` = the HTTP status and
``type`` from `ERROR_TYPES` unless given.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from kvroute.prompt import CHAT_COMPLETIONS_PATH, TokenizerBusy
from kvroute.serving.limits import BodyTooLarge

__all__ = [
    "CHAT_PATH", "COMPLETIONS_PATH", "ERROR_TYPES", "STAGE_ERRORS", "error_response",
    "limit_response", "stage_error",
    "decision_dict", "scores_list", "jsonable",
]

COMPLETIONS_PATH = "/v1/completions"

#: What the parse and tokenize stages raise for a request they refuse (`stage_error`).
STAGE_ERRORS = (ValueError, BodyTooLarge, TokenizerBusy, ClientDisconnect)
CHAT_PATH = CHAT_COMPLETIONS_PATH

EXPLAIN_HEADER = "x-kvroute-explain"
WORKER_HEADER = "x-kvroute-worker"
DECISION_HEADER = "x-kvroute-decision"
SCORES_HEADER = "x-kvroute-scores"
TENANT_HEADER = "x-kvroute-tenant"
PID_HEADER = "x-kvroute-pid"  # GET /health: the answering process
UDS_SCHEME = "unix://"
DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM serving_engine._get_data_parallel_rank
ORCA_FORMAT_HEADER = "endpoint-load-metrics-format"  # vLLM serve/utils/orca_metrics.py

#: The error ``type`` of each status (the OpenAI client's exception names).
ERROR_TYPES: Dict[int, str] = {
    400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
    404: "NotFoundError", 405: "MethodNotAllowedError", 409: "ConflictError",
    413: "RequestEntityTooLargeError", 422: "BadRequestError", 429: "RateLimitError",
    501: "NotImplementedError", 502: "BadGatewayError", 503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_response(status: int, message: str, err_type: Optional[str] = None,
                   param: Optional[str] = None,
                   headers: Optional[Mapping[str, str]] = None) -> JSONResponse:
    """A JSON error response: ``{"error": {"message", "type", "param", "code"}}``, ``code`` =
    ``status``, ``type`` = ``err_type`` or `ERROR_TYPES` (``InternalServerError`` for a
    status not listed)."""
    kind = err_type or ERROR_TYPES.get(status, "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status, headers=headers)


def stage_error(e: BaseException) -> Response:
    """The answer to an error of the parse or tokenize stage (`STAGE_ERRORS`): 499 (logged
    only) for a client gone while sending its body, `limit_response` for a body over the
    limit or a full tokenizer lane, else 400 with the error's message."""
    if isinstance(e, ClientDisconnect):
        return Response(status_code=499)
    if not isinstance(e, ValueError):
        return limit_response(e)  # type: ignore[arg-type]
    return error_response(400, str(e))


def limit_response(e: Exception) -> JSONResponse:
    """413 for a body over ``max_body_bytes`` (`kvroute.serving.limits.BodyTooLarge`), 503
    (``Retry-After: 1``) for a full tokenizer lane (`kvroute.prompt.TokenizerBusy`)."""
    if isinstance(e, BodyTooLarge):
        return error_response(413, str(e))
    return error_response(503, str(e), headers={"Retry-After": "1"})


def decision_dict(d: Any, attempts: int = 1, request_id: Optional[str] = None
                  ) -> Dict[str, Any]:
    """A `kvroute.Decision` as JSON-ready fields (``scores`` not included; see
    `scores_list`): ``request_id`` is the request's ``x-request-id`` (None when not known),
    ``decision_id`` the router's own counter of decisions."""
    return {"worker": d.worker, "matched_tokens": int(d.matched_tokens),
            "matched_blocks": int(d.matched_blocks), "prompt_tokens": int(d.prompt_tokens),
            "available_tokens": int(d.available_tokens),
            "prefill_tokens": int(d.prefill_tokens), "policy": d.policy, "reason": d.reason,
            "fallback": bool(d.fallback), "degraded": bool(d.degraded),
            "request_id": request_id, "decision_id": int(d.request_id),
            "attempts": attempts}


def scores_list(d: Any) -> List[Dict[str, Any]]:
    """Per-worker score terms of a decision made with ``explain=True``: ``worker``,
    ``matched_blocks``, ``match`` (tier-weighted matched share of the prompt, [0, 1]),
    ``load`` ([0, 1]) and ``score`` (the policy's value; see ``kvroute.Router``)."""
    return [{"worker": s.worker, "matched_blocks": int(s.matched_blocks),
             "match": round(float(s.match), 6), "load": round(float(s.load), 6),
             "score": round(float(s.score), 6)} for s in (d.scores or [])]


def jsonable(x: Any) -> Any:
    """``x`` as JSON-ready values: mappings, sequences, named tuples and objects' ``vars``
    recursively, anything else as ``str``."""
    if x is None or isinstance(x, (str, int, float, bool)):
        return x
    if isinstance(x, Mapping):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "_asdict"):
        return jsonable(x._asdict())
    if hasattr(x, "__dict__"):
        return jsonable(vars(x))
    return str(x)
