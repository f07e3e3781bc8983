"""Speculative decoding: proposers, verification and the engine-side glue.

Kept import-light (no torch here): ``engine.config`` imports ``spec_decode.config``, and the
scheduler, which imports the config, must not pull in torch.
"""
