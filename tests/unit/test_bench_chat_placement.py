"""bench/chat_placement.py: --spread is refused by a checkout whose picker
has no PREFIX_SPREAD, not set where nothing reads it."""

from __future__ import annotations

import pytest

from bench.chat_placement import main


def test_spread_is_refused_where_the_picker_has_none(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--spread", "2", "--setup", "3x3k", "--runs", "1", "--chats", "3"])
    assert exc.value.code == 2
    assert "has no PREFIX_SPREAD" in capsys.readouterr().err
