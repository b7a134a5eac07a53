"""Ids in a path reach their handler as the client meant them."""

from __future__ import annotations

from afmd.config.load import load_config
from afmd.server import Server


def test_every_route_with_a_path_parameter_decodes_it() -> None:
    """Sanic hands a path parameter over still percent-encoded unless its route says
    ``unquote``, and the SDKs encode the ids they put in a path; a route added without it
    would find none of the ids with a character the SDK encodes. (A ``path`` parameter,
    which Sanic matches by a regular expression and never decodes, is decoded by its
    handler: ``tests/server/test_openai_client.py`` sends one.)"""
    server = Server(load_config(None, env={}, overrides={"server.port": 0}))
    server.app.finalize()
    with_params = [r for r in server.app.router.routes if r.params]
    assert len(with_params) >= 10
    assert [r.path for r in with_params if not r.unquote] == []
