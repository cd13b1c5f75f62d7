"""A web page calls the proxy from a real browser (`--cors-origins`).

Real processes (etcd, a control plane, an origin, a proxy) and Debian's
Chromium: a page served from a listed origin streams a chat answer with
fetch(), as a browser app with a user's token would, and reads the answer's
headers; a page from another origin is stopped by the browser at the
preflight, so its call never reaches an origin.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from ponto.fleet import Fleet, RegionDef
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb
from tests.e2e.loopback import LoopbackServer, QuietHandler
from tests.e2e.statuspage import chromium

pytestmark = pytest.mark.e2e

# The page's script: a streamed chat call, read to its end. Its result (or
# the error fetch() rejects with) is handed back to the test.
STREAM = """
const [proxy, key, done] = arguments;
fetch(proxy + "/v1/chat/completions", {
  method: "POST",
  headers: {"authorization": "Bearer " + key, "content-type": "application/json"},
  body: JSON.stringify({model: "sim-small", stream: true,
                        messages: [{role: "user", content: "hello from a page"}]}),
}).then(async (resp) => {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let text = "";
  for (;;) {
    const {value, done: end} = await reader.read();
    if (end) break;
    text += decoder.decode(value);
  }
  done({status: resp.status, requestId: resp.headers.get("x-request-id"), text: text});
}).catch((err) => done({error: String(err)}));
"""


class Page(QuietHandler):
    def do_GET(self) -> None:
        body = b"<!doctype html><title>app</title>"
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Pages(LoopbackServer):
    """Serves an empty page on a loopback port: a web origin of its own."""

    def __init__(self) -> None:
        super().__init__(Page)
        self.origin = f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def pages() -> Iterator[tuple[Pages, Pages]]:
    listed, other = Pages(), Pages()
    yield listed, other
    listed.close()
    other.close()


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, pages: tuple[Pages, Pages]
) -> Iterator[tuple[Fleet, str]]:
    with Fleet(tmp_path_factory.mktemp("cors")) as f:
        f.start_etcd()
        f.start_control()
        f.add_region(RegionDef("us-east", 38.9, -77.4))
        f.start_origin("o1", "us-east")
        f.add_origin("o1", "us-east", f.origin_url("o1"), ("sim-small",))
        admin = f.admin()
        admin.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="web")), timeout=10)
        key = admin.CreateKey(apb.CreateKeyRequest(tenant="web"), timeout=10).secret
        f.start_proxy("p1", "us-east", extra=[f"--cors-origins={pages[0].origin}"])
        f.wait_proxies_at(f.wait_table(lambda t: len(t.keys) == 1 and len(t.origins) == 1))
        yield f, key


def origin_requests(fleet: Fleet) -> int:
    stats = httpx.get(f"http://{fleet.origins['o1'].address}/sim/stats", timeout=5).json()
    return int(stats["requests"])


def test_a_listed_origins_page_streams_an_answer_and_another_is_stopped(
    fleet: tuple[Fleet, str], pages: tuple[Pages, Pages]
) -> None:
    f, key = fleet
    proxy = f.proxy_url("p1").removesuffix("/v1")
    with chromium() as browser:
        browser.set_script_timeout(30)
        browser.get(pages[0].origin + "/")
        result = browser.execute_async_script(STREAM, proxy, key)
        assert result.get("status") == 200, result
        assert len(result["requestId"]) == 32  # an exposed header, readable by the page
        assert "data: [DONE]" in result["text"]
        before = origin_requests(f)
        browser.get(pages[1].origin + "/")
        refused = browser.execute_async_script(STREAM, proxy, key)
        assert refused == {"error": "TypeError: Failed to fetch"}
        assert origin_requests(f) == before
    log = f.members()["p1"].log_path.read_text()
    assert "cors_origin_not_allowed" in log and "Traceback" not in log
