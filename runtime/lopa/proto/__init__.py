"""Generated gRPC stubs of protos/lopa/v1 (regenerate with `python -m lopa.proto.generate`)."""
