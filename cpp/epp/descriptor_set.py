"""Writes the FileDescriptorSet of Envoy's ext_proc service and everything it imports, taken
from the ``xds-protos`` package's generated Python (which embeds each .proto's descriptor), and
prints the .proto names to generate C++ for (all but google/protobuf's, which libprotobuf has).

Run by CMake (cpp/epp): ``python descriptor_set.py OUT.pb``; protoc then reads OUT.pb with
``--descriptor_set_in``, so no .proto source of Envoy's is needed in this tree.
"""

import sys

from envoy.service.ext_proc.v3 import external_processor_pb2
from google.protobuf import descriptor_pb2


def main() -> None:
    seen = {}

    def walk(fd):
        if fd.name in seen:
            return
        for dep in fd.dependencies:
            walk(dep)
        proto = descriptor_pb2.FileDescriptorProto()
        fd.CopyToProto(proto)
        seen[fd.name] = proto

    walk(external_processor_pb2.DESCRIPTOR)
    with open(sys.argv[1], "wb") as f:
        f.write(descriptor_pb2.FileDescriptorSet(file=list(seen.values())).SerializeToString())
    print(";".join(n for n in seen if not n.startswith("google/protobuf/")), end="")


if __name__ == "__main__":
    main()
