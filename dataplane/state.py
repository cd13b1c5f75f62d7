"""Typed keys of the proxy's app state."""

from __future__ import annotations

from aiohttp import web

from dataplane.edgecache import EdgeCache
from dataplane.geo.home import ClientLocator
from dataplane.metrics import Metrics
from dataplane.quota import QuotaState
from dataplane.ratelimit.limiter import RateLimiter
from dataplane.settings import Settings
from dataplane.sync import ControlPlaneClient, TableHolder
from dataplane.upstream import Forwarder

SETTINGS = web.AppKey("settings", Settings)
HOLDER = web.AppKey("holder", TableHolder)
CLIENT = web.AppKey("control_plane_client", ControlPlaneClient)
FORWARDER = web.AppKey("forwarder", Forwarder)
METRICS = web.AppKey("metrics", Metrics)
LOCATOR = web.AppKey("locator", ClientLocator)
LIMITER = web.AppKey("limiter", RateLimiter)
CACHE = web.AppKey("cache", EdgeCache)
QUOTA = web.AppKey("quota", QuotaState)


class Draining:
    """Set once SIGTERM arrived: answers carry `Connection: close` from then on.

    One per app, written by the entry point, read by the middleware; the event
    loop is the only thread touching it.
    """

    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active = False


DRAINING = web.AppKey("draining", Draining)
