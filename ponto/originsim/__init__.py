"""OpenAI-compatible origin simulator for demos, tests and benchmarks.

Run it with ``ponto-origin-sim`` (see :mod:`ponto.originsim.__main__`) or embed
it in-process::

    from aiohttp import web
    from ponto.originsim import SimConfig, build_app

    app = build_app(SimConfig(name="eu-1", region="eu-west", ttft_ms=50))
    # serve ``app`` with aiohttp's TestServer, AppRunner or web.run_app
"""

from ponto.originsim.app import SIM_STATE, Mode, SimConfig, SimState, build_app

__all__ = ["SIM_STATE", "Mode", "SimConfig", "SimState", "build_app"]
