"""The gateway's relay with Ray's deployment handle faked by a replica that forwards to a real server over
HTTP and can die: a stream cut by a dead replica ends with an error event and [DONE] (the official openai
client raises rather than return a truncated completion), a replica lost before answering is retried, and
/health is 503 until the deployment runs every replica (the real-Ray behaviour is in test_ray_serve.py)."""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn

pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")

from ray.exceptions import RayActorError
from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger, ReplicaState
from ray.serve.exceptions import BackPressureError
from ray.serve.schema import (
    ApplicationStatus,
    ApplicationStatusOverview,
    DeploymentStatusOverview,
    ServeStatus,
)

from promptcache.cluster.forwarded import ForwardedRequest
from promptcache.cluster.gateway import Gateway
from promptcache.cluster.readiness import DeploymentHealth, ReplicaReadiness
from tests.model_factories import make_tiny_loaded
from tests.redis_server import free_port
from tests.server.conftest import LiveServer, settings_for

HOP_BY_HOP = {b"host", b"content-length", b"transfer-encoding", b"connection"}


class FakeReplicas:
    """The deployment handle as the gateway uses it (`options(stream=True).forward.remote(request)`), served
    by a real promptcache server. The replica dies (RayActorError, as Ray raises it) before answering
    `num_lost_before` times, and `die_after_events` SSE events into a stream when set; every replica's
    queue is full (BackPressureError) while `is_busy`."""

    app_name, deployment_name = "promptcache", "PromptCacheReplica"

    def __init__(self, url: str) -> None:
        self.url = url
        self.num_lost_before = 0
        self.die_after_events: int | None = None
        self.is_busy = False
        self.num_calls = 0

    def options(self, **_) -> FakeReplicas:
        return self

    @property
    def forward(self) -> FakeReplicas:
        return self

    async def remote(self, request: ForwardedRequest):
        self.num_calls += 1
        if self.is_busy:
            raise BackPressureError(num_queued_requests=16, max_queued_requests=16)
        if self.num_lost_before > 0:
            self.num_lost_before -= 1
            raise RayActorError()
        headers = [(k.decode(), v.decode()) for k, v in request.headers if k.lower() not in HOP_BY_HOP]
        async with httpx.AsyncClient(timeout=60) as client, \
                client.stream(request.method, self.url + request.path, content=request.body, headers=headers) as answer:
            yield {"type": "http.response.start", "status": answer.status_code,
                   "headers": [(k.lower(), v) for k, v in answer.headers.raw if k.lower() not in HOP_BY_HOP]}
            buffer, num_events = b"", 0
            async for chunk in answer.aiter_raw():
                buffer += chunk
                while b"\n\n" in buffer:  # one body message per SSE event
                    event, buffer = buffer.split(b"\n\n", 1)
                    if self.die_after_events is not None and num_events == self.die_after_events:
                        raise RayActorError()
                    yield {"type": "http.response.body", "body": event + b"\n\n", "more_body": True}
                    num_events += 1
            yield {"type": "http.response.body", "body": buffer, "more_body": False}


class FakeReadiness(ReplicaReadiness):
    def __init__(self) -> None:
        super().__init__("promptcache", "PromptCacheReplica", cache_s=0)
        self.now = DeploymentHealth("HEALTHY", {"RUNNING": 2})

    def read(self) -> DeploymentHealth:
        return self.now


@contextlib.contextmanager
def _serving(relay: Gateway) -> Iterator[int]:
    """`relay` on a real HTTP server; yields its port."""
    port = free_port()
    front = uvicorn.Server(uvicorn.Config(relay.relay, host="127.0.0.1", port=port, lifespan="off",
                                          interface="asgi3", log_level="warning"))
    thread = threading.Thread(target=front.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not front.started:
        assert time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        front.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def gateway():
    server = LiveServer(settings_for(), lambda: make_tiny_loaded("llama")).start()
    replicas = FakeReplicas(server.url)
    relay = Gateway(replicas)
    relay.readiness = FakeReadiness()
    with _serving(relay) as port:
        yield f"http://127.0.0.1:{port}", replicas, relay
    server.stop()


def _stream_body(**extra) -> dict:
    return {"model": "m", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True, **extra}


def test_a_stream_whose_replica_dies_ends_with_an_error_event_and_done(gateway):
    url, replicas, _ = gateway
    replicas.die_after_events = 3
    try:
        with httpx.stream("POST", url + "/v1/completions", json=_stream_body(), timeout=60) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    finally:
        replicas.die_after_events = None
    assert len(events) == 5 and events[-1] == "[DONE]", events
    assert all("choices" in json.loads(e) for e in events[:3])
    error = json.loads(events[3])["error"]
    assert error["type"] == "replica_lost" and error["status"] == 503


def test_the_openai_client_raises_on_a_cut_stream_instead_of_returning_it_truncated(gateway):
    url, replicas, _ = gateway
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    body = {k: v for k, v in _stream_body().items() if k not in ("stream", "ignore_eos")}
    extra = {"extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**body, **extra)
    assert whole.choices[0].finish_reason == "length"  # through the gateway, a live replica answers whole
    replicas.die_after_events = 2
    try:
        received = []
        with pytest.raises(openai.APIError, match="replica serving this stream stopped"):
            for chunk in client.completions.create(**body, **extra, stream=True):
                received.append(chunk.choices[0].text)
    finally:
        replicas.die_after_events = None
    assert len(received) == 2


def test_a_replica_lost_before_answering_is_retried(gateway):
    url, replicas, _ = gateway
    before = replicas.num_calls
    replicas.num_lost_before = 2
    response = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert response.status_code == 200 and replicas.num_calls - before == 3


def test_busy_and_lost_replicas_are_503s_from_the_error_table(gateway):
    """Every replica busy, or lost on every attempt: a 503 whose type, message and Retry-After come from
    the server's one error table (ReplicasBusyError, ReplicaLostError), in its error body."""
    url, replicas, relay = gateway
    body = {"model": "m", "prompt": "Hi", "max_tokens": 2}
    replicas.is_busy = True
    try:
        busy = httpx.post(url + "/v1/completions", json=body, timeout=60)
    finally:
        replicas.is_busy = False
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    assert busy.json()["error"] == {"type": "service_unavailable", "message": "every replica is busy; retry shortly"}
    before = replicas.num_calls
    replicas.num_lost_before = relay.max_attempts
    lost = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert replicas.num_calls - before == relay.max_attempts
    assert lost.status_code == 503 and lost.headers["retry-after"] == "1"
    assert lost.json()["error"]["type"] == "replica_lost" and "no replica" in lost.json()["error"]["message"]


def test_health_is_503_until_every_replica_runs(gateway):
    url, _, relay = gateway
    relay.readiness.now = DeploymentHealth("UPDATING", {"RUNNING": 1, "STARTING": 1})
    try:
        starting = httpx.get(url + "/health", timeout=30)
        assert starting.status_code == 503
        assert starting.json() == {"status": "not_ready", "deployment_status": "UPDATING",
                                   "replicas": {"RUNNING": 1, "STARTING": 1}}
        relay.readiness.now = DeploymentHealth("UNHEALTHY", {"RUNNING": 1})  # one died, not yet replaced
        assert httpx.get(url + "/health", timeout=30).status_code == 503
    finally:
        relay.readiness.now = DeploymentHealth("HEALTHY", {"RUNNING": 2})
    ready = httpx.get(url + "/health", timeout=30)
    assert ready.status_code == 200 and ready.json()["status"] == "ok"  # the replica's own answer


def test_a_request_without_a_key_is_a_401_before_its_body_is_read(gateway):
    _, shared, _ = gateway  # the module's replica server, behind a gateway with a key
    replicas = FakeReplicas(shared.url)
    relay = Gateway(replicas, settings={"api_keys": ["sk-a"]})
    relay.readiness = FakeReadiness()

    def send_unfinished(port: int, method: str, path: str, key: str | None) -> http.client.HTTPResponse:
        """A request announcing a 2 MiB body of which only the start ever comes."""
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.putrequest(method, path)
        conn.putheader("Content-Length", str(2 << 20))
        if key is not None:
            conn.putheader("Authorization", f"Bearer {key}")
        conn.endheaders(b'{"prompt": "')
        return conn.getresponse()  # answered only by a gateway that does not wait for the body

    with _serving(relay) as port:
        for key in (None, "sk-wrong"):
            refused = send_unfinished(port, "POST", "/v1/completions", key)
            assert refused.status == 401 and "API key" in json.loads(refused.read())["error"]["message"]
        health = send_unfinished(port, "GET", "/health", None)  # an open path takes no body at all
        assert health.status == 413 and json.loads(health.read())["error"]["message"] == \
            "/health takes no request body"
        assert replicas.num_calls == 0
        body = {"model": "m", "prompt": "Hi", "max_tokens": 2}
        served = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                            headers={"Authorization": "Bearer sk-a"}, timeout=60)
        assert served.status_code == 200 and replicas.num_calls == 1


def test_readiness_reads_rays_deployment_status(monkeypatch):
    from ray import serve

    def status(deployment_status: DeploymentStatus, states: dict) -> ServeStatus:
        deployment = DeploymentStatusOverview(status=deployment_status,
                                              status_trigger=DeploymentStatusTrigger.CONFIG_UPDATE_STARTED,
                                              replica_states=states, message="")
        return ServeStatus(applications={"promptcache": ApplicationStatusOverview(
            status=ApplicationStatus.DEPLOYING, message="", last_deployed_time_s=0.0,
            deployments={"PromptCacheReplica": deployment})})

    readiness = ReplicaReadiness("promptcache", "PromptCacheReplica", cache_s=0)
    cases = [(DeploymentStatus.UPDATING, {ReplicaState.RUNNING: 1, ReplicaState.STARTING: 1}, False),
             (DeploymentStatus.HEALTHY, {ReplicaState.RUNNING: 2}, True),
             (DeploymentStatus.UPSCALING, {ReplicaState.RUNNING: 2, ReplicaState.STARTING: 1}, True),
             (DeploymentStatus.UNHEALTHY, {ReplicaState.RUNNING: 1}, False)]
    for deployment_status, states, ready in cases:
        monkeypatch.setattr(serve, "status", lambda s=deployment_status, r=states: status(s, r))
        health = readiness.read()
        assert health.is_ready is ready and health.status == deployment_status.value
        assert health.replicas == {state.value: count for state, count in states.items()}
    monkeypatch.setattr(serve, "status", lambda: ServeStatus())
    assert not readiness.read().is_ready  # not deployed (yet)
