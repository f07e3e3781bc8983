"""Parallelism inside one engine: ``tensor`` splits a model across ranks (torch.distributed)."""
