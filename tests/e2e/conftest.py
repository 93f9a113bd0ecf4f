"""End-to-end fixtures reuse the live-server fixture of the server tests."""

from tests.server.conftest import live_server  # noqa: F401 (fixture)
