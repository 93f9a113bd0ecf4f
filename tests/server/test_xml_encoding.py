"""Over HTTP, a schema declaring another encoding than UTF-8 is one 400, whether the file it names exists or not."""

from __future__ import annotations

import httpx

from tests.pml.test_declared_encoding import files, payloads

__all__ = ["files"]  # the fixture


def test_upload_answers_one_400_for_existing_and_missing_files(live_server, files):
    server = live_server()
    for name, (with_existing, with_missing) in payloads(*files).items():
        answers = [httpx.post(server.url + "/v1/schemas", json={"pml": text}) for text in (with_existing, with_missing)]
        assert [a.status_code for a in answers] == [400, 400], name
        bodies = [a.json() for a in answers]
        assert bodies[0] == {"error": {**bodies[1]["error"],
                                       "message": bodies[1]["error"]["message"].replace(files[1], files[0])}}, name
    assert httpx.get(server.url + "/v1/schemas").json()["data"] == []
