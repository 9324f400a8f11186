"""HTTP (FastAPI, with a bare ASGI infer route) and gRPC ingress."""
