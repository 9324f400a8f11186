"""Generated gRPC code for api/proto/inference.proto (see that file for how to regenerate)."""
