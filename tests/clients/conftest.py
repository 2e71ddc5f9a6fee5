"""The client tests share the server tests' live server (random:mingru-tiny on a free 127.0.0.1 port)."""

from tests.server.conftest import live_url

__all__ = ["live_url"]
