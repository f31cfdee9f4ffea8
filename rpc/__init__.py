"""trioserve's gRPC service (``trioserve serve --grpc-port``; docs/api.md).

``trioserve_pb2*`` are generated from ``proto/trioserve.proto`` by
``codegen.py`` (``make proto``) and committed; ``service.py`` serves them.
A front end beside the HTTP one, on the actors' ``Engine``: the server
(web/) is above it and hands it the host, the plugins and the error
translation (``host.py`` says what of them it uses); rpc/ imports nothing
of web/.
"""
