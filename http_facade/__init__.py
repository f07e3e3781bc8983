"""sluice's HTTP facade: OpenAI- and MLC-compatible REST/SSE over the engine's gRPC API.

Imports only the generated gRPC stubs (``sluice.engine.rpc``), never torch or engine internals.
"""
