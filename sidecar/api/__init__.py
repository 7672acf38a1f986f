"""Wire <-> domain, for the server and the SDK alike: the only importer of the generated stubs.

One module per API area: ``kv`` (tokens, identity, layout, RoPE, Lookup plans, Store and Fetch
requests), ``sessions`` (directives, op plans, session state), ``claims``, ``manifests``;
``frames`` (Fetch frames, encoder and decoder side by side); ``payload`` (the KV payload views
every engine client reads). Every ``*_from_wire`` validates and names the field in the
``InvalidArgument`` it raises; nothing here changes state.

The generated stubs stay at ``sidecar.v1`` (``sidecar_pb2``, ``sidecar_pb2_grpc``): the path
protoc derives from the proto package, and the one raw-gRPC users import.
"""
