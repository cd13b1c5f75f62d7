"""Every pattern a name is checked by matches the whole name: with `$`, a
name ending in a newline ("p1\n") passed, and was stored and listed with it
(review 30)."""

from __future__ import annotations

import re

import pytest

from controlplane import catalog, model
from controlplane.errors import InvalidArgument
from dataplane import settings

PATTERNS = [
    (model.NAME_RE, "eu-west"),
    (settings.NAME_RE, "p1-w0"),
    (model.MODEL_RE, "meta-llama/Llama-3.1-8B"),
    (model.ENV_RE, "ORIGIN_TOKEN"),
    (model.PARAM_RE, "max_tokens"),
    (catalog.KEY_ID_RE, "k1a2b3"),
]


@pytest.mark.parametrize(("pattern", "valid"), PATTERNS)
def test_a_name_with_a_trailing_newline_is_refused(pattern: re.Pattern[str], valid: str) -> None:
    assert pattern.match(valid)
    assert not pattern.match(valid + "\n")


def test_the_control_plane_refuses_such_a_proxy_name() -> None:
    with pytest.raises(InvalidArgument):
        model.check_name("proxy", "p1\n")
    model.check_name("proxy", "p1")
