"""--origin-ca (ponto.originca): https origins behind a private CA, trusted by
the proxy's calls and the control plane's probes; a bad file refused at start."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from controlplane.health import ProbeSettings
from controlplane.settings import parse as parse_control
from dataplane.settings import parse as parse_proxy
from ponto.originca import TlsFileError, origin_ssl_context
from ponto.pki import make_bundle
from tests.tlsorigin import serving_tls


def test_no_file_means_the_http_clients_default() -> None:
    assert origin_ssl_context("") is None


def test_a_file_that_is_missing_or_holds_no_certificate_is_refused_by_name(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(TlsFileError, match=f"cannot read origin CA {missing}"):
        origin_ssl_context(str(missing))
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(TlsFileError, match=f"origin CA {junk}: it holds no PEM certificate"):
        origin_ssl_context(str(junk))


@pytest.mark.parametrize("proxy", [True, False], ids=["proxy", "control"])
def test_both_processes_refuse_a_bad_origin_ca_at_start_in_one_line(
    proxy: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.pem"
    flags = ["--origin-ca", str(missing)]
    with pytest.raises(SystemExit) as exit_:
        if proxy:
            parse_proxy([*flags, "--region", "r"])
        else:
            parse_control(flags)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"cannot read origin CA {missing}" in err and "(--origin-ca)" in err


def test_both_processes_take_a_good_origin_ca(tmp_path: Path) -> None:
    ca = make_bundle(tmp_path).ca
    upstream = parse_proxy(["--region", "r", "--origin-ca", ca]).upstream
    probe = parse_control(["--origin-ca", ca]).probe
    assert upstream.origin_ca == probe.origin_ca == ca
    # Read once, with the flags: what calls and probes use from then on.
    assert upstream.origin_ssl is not None and probe.origin_ssl is not None


async def test_the_control_planes_probes_trust_the_origin_ca(tmp_path: Path) -> None:
    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    async with serving_tls(app, tmp_path) as (root, bundle):
        trusting = ProbeSettings(origin_ca=bundle.ca, origin_ssl=origin_ssl_context(bundle.ca))
        Path(bundle.ca).unlink()  # read once, when the flags were: not at each term
        for settings, ok in ((trusting, True), (ProbeSettings(), False)):
            async with aiohttp.ClientSession(connector=settings.connector()) as session:
                try:
                    async with session.get(root / "health") as resp:
                        answered = resp.status == 200
                except aiohttp.ClientConnectorCertificateError:
                    answered = False
            assert answered is ok
