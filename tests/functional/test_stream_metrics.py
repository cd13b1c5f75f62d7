"""What a stream leaves in the proxy's metrics while it runs and once it ends:
requests in flight and open streams, the origin's time to commit, the time per
output chunk; and an origin's ejection counter from the first table that names
it. The real proxy app on EdgeRunner before a hand-written origin whose every
event the test lets out (tests/functional/test_flight_leader_gone.py), so that
"while it runs" is a state the test holds, not a moment it hopes to catch."""

from __future__ import annotations

from dataplane.http.state import HOLDER, METRICS
from tests.functional.test_flight_leader_gone import FRAMES, WORDS, Client, Origin, clients, start
from tests.functional.test_pipeline import MODEL
from tests.functional.test_whole_answers import Edge, Start, until

__all__ = ["clients", "start"]  # fixtures


def origin_name(edge: Edge) -> str:
    routes = edge.app[HOLDER].routes
    assert routes is not None
    [name] = routes.origins
    return name


def total(edge: Edge, name: str) -> float:
    """The sum of a family's samples `name` over their labels."""
    return sum(
        s.value
        for family in edge.app[METRICS].registry.collect()
        for s in family.samples
        if s.name == name
    )


async def test_a_stream_is_in_flight_while_it_runs_and_timed_once_it_ends(
    start: Start, clients: list[Client]
) -> None:
    origin = Origin()
    edge = await start(origin)
    name = origin_name(edge)
    # Exported at 0 from the first table, so increase() sees the first ejection.
    assert edge.sample("ponto_origin_ejections_total", {"origin": name}) == 0
    assert edge.sample("ponto_requests_in_flight", {}) == 0
    client = Client(edge)
    clients.append(client)
    origin.let(2)
    await client.send()
    assert len(await client.events(2)) == 2
    # The stream is held open by the origin: one request in flight, one stream.
    assert edge.sample("ponto_requests_in_flight", {}) == 1
    assert edge.sample("ponto_streams_open", {}) == 1
    commit = {"origin": name, "kind": "stream"}
    assert edge.sample("ponto_upstream_time_to_commit_seconds_count", commit) == 1
    origin.let(len(FRAMES) - 2)
    await client.rest()
    ok = {"endpoint": "chat.completions", "code": "200"}
    await until(lambda: edge.sample("ponto_requests_total", ok) == 1)
    assert edge.sample("ponto_requests_in_flight", {}) == 0
    assert edge.sample("ponto_streams_open", {}) == 0
    gap = {
        "gen_ai_operation_name": "chat",
        "gen_ai_provider_name": "openai",
        "gen_ai_request_model": MODEL,
        "ponto_region": "r1",
        "ponto_cache": "miss",
    }
    name_gap = "ponto_stream_mean_chunk_interval_seconds"
    assert edge.sample(f"{name_gap}_count", gap) == 1  # once per stream, not per chunk
    mean = edge.sample(f"{name_gap}_sum", gap)
    duration = edge.sample(
        "gen_ai_client_operation_duration_seconds_sum", {**gap, "error_type": ""}
    )
    assert mean is not None and duration is not None
    # The span after the first chunk over the text chunks less one, so below
    # the whole duration over as many.
    assert 0 < mean <= duration / (len(WORDS) - 1)
    assert total(edge, "ponto_upstream_time_to_commit_seconds_count") == 1
