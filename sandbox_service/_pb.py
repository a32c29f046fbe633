"""Protobuf messages and gRPC stubs, generated at import time from proto/sandbox.proto.

Generating at run time keeps the stubs in step with the installed grpcio/protobuf (no checked-in
files tied to one grpcio-tools version).
"""

from __future__ import annotations

import os
import sys

import grpc

# grpc_tools resolves the .proto (and the generated module names) against sys.path entries; an
# editable or zipped install may not put the package's parent there, so add it for the duration.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_added = _ROOT not in sys.path
if _added:
    sys.path.insert(0, _ROOT)
try:
    pb2, pb2_grpc = grpc.protos_and_services("sandbox_service/proto/sandbox.proto")
finally:
    if _added:
        sys.path.remove(_ROOT)
