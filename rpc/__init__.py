"""trioserve's gRPC service (``trioserve serve --grpc-port``; docs/api.md).

``trioserve_pb2*`` are generated from ``proto/trioserve.proto`` by
``codegen.py`` (``make proto``) and committed; ``server.py`` serves them.
"""
