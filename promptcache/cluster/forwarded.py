"""ForwardedRequest: one HTTP request as data, from the gateway to the replica chosen to serve it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    """What the gateway read off the wire (the whole body included), so that the request router can look
    at the body before a replica is picked and the replica can replay it into its FastAPI app."""

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None
    scheme: str = "http"
    http_version: str = "1.1"

    @classmethod
    def from_scope(cls, scope: Mapping[str, Any], body: bytes) -> ForwardedRequest:
        """The request of an ASGI http `scope` whose body was `body`; the path is relative to the
        gateway's root path, as the replica's routes expect."""
        root, path = scope.get("root_path", ""), scope["path"]
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        client = scope.get("client")
        return cls(method=scope["method"], path=path, query_string=scope.get("query_string", b""),
                   headers=tuple((bytes(k), bytes(v)) for k, v in scope.get("headers", ())), body=body,
                   client=tuple(client) if client else None, scheme=scope.get("scheme", "http"),
                   http_version=scope.get("http_version", "1.1"))

    def header(self, name: str) -> str:
        """The first value of header `name` (case-insensitive), '' when absent."""
        wanted = name.lower().encode("latin-1")
        return next((value.decode("latin-1") for key, value in self.headers if key.lower() == wanted), "")

    def asgi_scope(self) -> dict[str, Any]:
        """An ASGI http scope that replays this request into an app."""
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                "http_version": self.http_version, "method": self.method, "scheme": self.scheme,
                "path": self.path, "raw_path": self.path.encode("utf-8"), "root_path": "",
                "query_string": self.query_string, "headers": list(self.headers),
                "client": list(self.client) if self.client else None, "server": None, "state": {}}
