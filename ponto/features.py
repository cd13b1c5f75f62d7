"""What a build enforces of the route table, by name, for the settings that
only some builds know: a proxy lists them when it registers
(`ProxyInfo.features`), a control-plane replica in its announcement, and a
write that saves such a setting warns of the processes that do not list it
(trial 69: during a rolling upgrade, a suspended tenant's and key's callers
were served by an older proxy, and by every proxy while an older replica led,
and nothing said so).

A name is added here with the setting it gates, and never removed. A build
from before this list lists nothing: it is taken to lack every name.
"""

from __future__ import annotations

from typing import Final

__all__ = ["FEATURES", "KEY_SUSPENSION"]

# ApiKey.suspended: refused 403 api_key_suspended (proxies); compiled into
# the table and kept when a key is rewritten (replicas).
KEY_SUSPENSION: Final = "key_suspension"

FEATURES: Final = (KEY_SUSPENSION,)
