"""An https server on 127.0.0.1 whose certificate a private CA issued (ponto.pki's
bundle: the CA is `bundle.ca`), for tests of what trusts it and what does not."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web
from yarl import URL

from ponto.pki import Bundle, make_bundle


@contextlib.asynccontextmanager
async def serving_tls(app: web.Application, directory: Path) -> AsyncIterator[tuple[URL, Bundle]]:
    """`app` over https; yields its root URL and the bundle of its CA."""
    bundle = make_bundle(directory)
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(bundle.path("server.crt"), bundle.path("server.key"))
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_side)
        await site.start()
        yield URL(f"https://127.0.0.1:{runner.addresses[0][1]}"), bundle
    finally:
        await runner.cleanup()
