"""Streams that do not break, with real processes: etcd, a control plane,
three simulated vLLM replicas and a proxy, read by the official openai client
and LangChain's ChatOpenAI.

The replica serving a stream is SIGKILLed at a random token; the client reads
one unbroken stream whose text equals the uncut answer (the simulator's answers
are a function of the prompt, and it continues a final assistant message as
vLLM does). With continuation off, the client gets today's error event.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from langchain_openai import ChatOpenAI
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam
from pydantic import SecretStr

from ponto.fleet import Fleet, RegionDef
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb

pytestmark = pytest.mark.e2e

REGION = RegionDef("us-east", 38.9, -77.4)
REPLICAS = ("s0", "s1", "s2")
MODEL = "sim-small"
# 60 tokens at 100 a second: a stream lasts 0.6 s, long enough to be killed in.
SIM = ["--tokens-per-s", "100", "--answer-tokens", "60", "--seed", "7"]
RNG = random.Random(20261130)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with Fleet(tmp_path_factory.mktemp("streams")) as f:
        f.start_etcd()
        f.start_control(extra=["--probe-interval-ms", "200", "--rise", "1", "--fall", "1"])
        f.add_region(REGION)
        for name in REPLICAS:
            f.start_origin(name, REGION.name, extra=SIM)
            f.add_origin(name, REGION.name, f.origin_url(name))
        version = f.table_version(origins=len(REPLICAS))
        f.start_proxy("p", REGION.name, extra=["--stream-idle-timeout", "2"])
        f.wait_proxies_at(version)
        yield f


def client(fleet: Fleet) -> OpenAI:
    # No SDK retries: a broken stream must not be hidden by a second request.
    return OpenAI(base_url=fleet.proxy_url("p"), api_key="unused", max_retries=0)


def revive(fleet: Fleet, name: str) -> None:
    """Restart a killed replica on its address and wait until the table has it healthy."""
    address = fleet.origins[name].address
    fleet.start_origin(name, REGION.name, listen=address, extra=SIM)
    fleet.wait_proxies_at(fleet.wait_table(lambda t: all(o.healthy for o in t.origins), timeout=15))


def killer(fleet: Fleet, after_chunks: int) -> Callable[[str, int], None]:
    """Kills the replica named in the answer once `after_chunks` chunks were read."""

    def maybe_kill(origin: str, seen: int) -> None:
        if seen == after_chunks:
            fleet.origins[origin].kill()

    return maybe_kill


def uncut_chat(fleet: Fleet, messages: list[ChatCompletionMessageParam]) -> str:
    r = client(fleet).chat.completions.create(model=MODEL, messages=messages)
    return r.choices[0].message.content or ""


@pytest.mark.parametrize("trial", range(3))
def test_openai_chat_stream_survives_its_replica_being_killed(fleet: Fleet, trial: int) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": f"tell me a story number {trial}"}
    ]
    expected = uncut_chat(fleet, messages)
    kill = killer(fleet, RNG.randrange(3, 50))
    raw = client(fleet).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
    )
    origin = raw.headers["x-ponto-origin"]
    text, finishes, usage, extra = "", [], None, []
    for seen, chunk in enumerate(raw.parse(), start=1):
        kill(origin, seen)
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].finish_reason:
                finishes.append(chunk.choices[0].finish_reason)
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.model_extra and "ponto" in chunk.model_extra:
            extra.append(chunk.model_extra["ponto"])
    assert text == expected
    assert finishes == ["stop"]
    assert usage is not None and usage.completion_tokens == 60
    assert {"continued": 1} in extra
    revive(fleet, origin)


def test_openai_completions_stream_survives_its_replica_being_killed(fleet: Fleet) -> None:
    prompt = "Once upon a time"
    expected = client(fleet).completions.create(model=MODEL, prompt=prompt).choices[0].text
    kill = killer(fleet, RNG.randrange(3, 50))
    raw = client(fleet).completions.with_raw_response.create(
        model=MODEL, prompt=prompt, stream=True
    )
    origin = raw.headers["x-ponto-origin"]
    text = ""
    for seen, chunk in enumerate(raw.parse(), start=1):
        kill(origin, seen)
        text += chunk.choices[0].text if chunk.choices else ""
    assert text == expected
    revive(fleet, origin)


def test_a_non_streamed_answer_survives_its_replica_being_killed(fleet: Fleet) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "a long answer please"}
    ]
    expected = uncut_chat(fleet, messages)
    probe = httpx.post(
        fleet.proxy_url("p") + "/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 1},
        timeout=10,
    )
    origin = probe.headers["x-ponto-origin"]  # the session's replica
    timer = threading.Timer(0.2, fleet.origins[origin].kill)  # mid-generation (0.6 s)
    timer.start()
    try:
        assert uncut_chat(fleet, messages) == expected
    finally:
        timer.join()
    revive(fleet, origin)


def test_langchain_reads_a_continued_stream(fleet: Fleet) -> None:
    question = "what does a lighthouse keeper do"
    expected = uncut_chat(fleet, [{"role": "user", "content": question}])
    llm = ChatOpenAI(
        model=MODEL,
        base_url=fleet.proxy_url("p"),
        api_key=SecretStr("unused"),
        max_retries=0,
    )
    probe = httpx.post(
        fleet.proxy_url("p") + "/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": question}]},
        timeout=10,
    )
    origin = probe.headers["x-ponto-origin"]
    text = ""
    for seen, part in enumerate(llm.stream(question), start=1):
        if seen == 10:
            fleet.origins[origin].kill()
        text += str(part.content)
    assert text == expected
    revive(fleet, origin)


def test_continuation_off_gives_the_error_event(fleet: Fleet) -> None:
    admin = fleet.admin()
    admin.PutTenant(
        apb.PutTenantRequest(
            tenant=pb.Tenant(name="default", streams=pb.StreamPolicy(continuation="off")),
            allow_update=True,
        ),
        timeout=10,
    )
    fleet.wait_proxies_at(fleet.wait_table(lambda t: any(x.name == "default" for x in t.tenants)))
    try:
        raw = client(fleet).chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "this one breaks"}],
            stream=True,
        )
        origin = raw.headers["x-ponto-origin"]
        with pytest.raises(openai.APIError, match="stopped answering mid-stream"):
            for seen, _ in enumerate(raw.parse(), start=1):
                if seen == 5:
                    fleet.origins[origin].kill()
                    time.sleep(0.05)
        revive(fleet, origin)
    finally:
        admin.DeleteTenant(apb.DeleteRequest(name="default"), timeout=10)


def test_a_stream_on_a_hung_replica_goes_on_once_the_leader_marks_it_unhealthy(
    fleet: Fleet,
) -> None:
    """Trial 27: a replica that hung (SIGSTOP: its connections stay open and
    silent, as a wedged GPU's) held its streams for the whole stream idle
    timeout, though the leader's probes marked it unhealthy at once. A proxy
    whose idle timeout is 60 s continues the stream on another replica once
    the table marks the hung one unhealthy; the client's read timeout (20 s)
    fails the test if it waits the 60 s."""
    proxy = fleet.start_proxy(
        "q",
        REGION.name,
        extra=["--stream-idle-timeout", "60", "--unhealthy-stream-idle-timeout", "1"],
    )
    try:
        fleet.wait_proxies_at(fleet.table_version(origins=len(REPLICAS)))
        q = OpenAI(base_url=fleet.proxy_url("q"), api_key="unused", max_retries=0, timeout=20.0)
        messages: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": "a story from a replica that hangs"}
        ]
        expected = q.chat.completions.create(model=MODEL, messages=messages)
        raw = q.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, stream=True
        )
        hung = fleet.origins[raw.headers["x-ponto-origin"]]
        text, extra = "", []
        try:
            for seen, chunk in enumerate(raw.parse(), start=1):
                if seen == 5:
                    os.kill(hung.pid, signal.SIGSTOP)
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                if chunk.model_extra and "ponto" in chunk.model_extra:
                    extra.append(chunk.model_extra["ponto"])
        finally:
            os.kill(hung.pid, signal.SIGCONT)
        assert text == expected.choices[0].message.content
        assert {"continued": 1} in extra
        assert "from an origin the route table marks unhealthy" in proxy.log_tail(200)
        fleet.wait_table(lambda t: all(o.healthy for o in t.origins), timeout=15)
    finally:
        fleet.proxies.pop("q").stop()
