"""``sluice serve`` / ``sluice facade`` flags of the AFS and embedding work, without starting
anything: ``--embedding-model`` / ``--rerank-model`` reach the engine's command line only when
given (the engine's own default otherwise), the AFS ping interval and query prefix reach the
facade's, and a bad ping interval is refused naming the flag."""
from __future__ import annotations

import argparse

import pytest

from sluice.http_facade.cli import add_facade_arguments, add_serve_arguments
from sluice.http_facade.options import afs_config
from sluice.http_facade.supervisor import build_plan, serve_from_args


def _serve_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(["smollm2", "--engine-port", "50124", *argv])


def test_embedding_flags_pass_through(monkeypatch):
    monkeypatch.setenv("SLUICE_API_KEYS", "")
    plan = build_plan(_serve_args("--embedding-model", "none", "--rerank-model", "/m/ce", "--afs-ping-interval", "2.5",
                                  "--afs-query-prefix", "query: "))
    engine, facade = list(plan.engine_cmd), list(plan.facade_cmd)
    assert engine[engine.index("--embedding-model") + 1] == "none"
    assert engine[engine.index("--rerank-model") + 1] == "/m/ce"
    assert facade[facade.index("--afs-ping-interval") + 1] == "2.5"
    assert facade[facade.index("--afs-query-prefix") + 1] == "query: "
    default = build_plan(_serve_args())
    assert "--embedding-model" not in default.engine_cmd and "--rerank-model" not in default.engine_cmd
    assert "--afs-query-prefix" not in default.facade_cmd


def test_facade_afs_options():
    p = argparse.ArgumentParser()
    add_facade_arguments(p)
    config = afs_config(p.parse_args(["--engine", "h:1", "--afs-ping-interval", "0.5"]))
    assert config.ping_interval_s == 0.5 and config.query_prefix is None
    with pytest.raises(ValueError, match="--afs-ping-interval"):
        afs_config(p.parse_args(["--engine", "h:1", "--afs-ping-interval", "0"]))


def test_serve_refuses_a_bad_ping_interval(capsys):
    assert serve_from_args(_serve_args("--afs-ping-interval", "-1")) == 2
    assert "--afs-ping-interval" in capsys.readouterr().err
