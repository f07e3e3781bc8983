"""The engine's gRPC edge: generated stubs (``engine_pb2``, ``engine_pb2_grpc``; committed,
regenerate with ``python -m sluice.engine.rpc.regen``), the servicer, the status mapping and the server.

Importing this package loads no torch: the client SDK and the HTTP facade use the stubs from here.
"""
