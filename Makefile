# The two commands a new machine needs: `make serve` and `make test`.
.PHONY: setup serve test

setup:
	./scripts/setup.sh

serve: setup
	.venv/bin/trioserve serve

test: setup
	.venv/bin/python -m pytest

# Regenerate rpc/'s gRPC code from proto/trioserve.proto (the generated files
# are committed, so installing needs no protoc; tests/test_grpc.py checks
# they match the proto).
.PHONY: proto
proto:
	.venv/bin/python -m trioserve.rpc.codegen
