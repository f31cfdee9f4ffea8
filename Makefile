# The two commands a new machine needs: `make serve` and `make test`.
.PHONY: setup serve test

setup:
	./scripts/setup.sh

serve: setup
	.venv/bin/trioserve serve

test: setup
	.venv/bin/python -m pytest
