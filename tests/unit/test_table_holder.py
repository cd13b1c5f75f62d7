"""TableHolder: apply, persist to the state dir, and reload after a restart."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dataplane.routes import TableError
from dataplane.sync.holder import TABLE_FILE, TableHolder
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb

CP = "control-plane"


def table(
    version: int, *, weight: int = 100, models: tuple[str, ...] = ("llama-3",)
) -> pb.RouteTable:
    t = pb.RouteTable(
        version=version,
        regions=[
            pb.Region(name="us-east", latitude=39.0, longitude=-77.0),
            pb.Region(name="eu-west", latitude=53.0, longitude=-6.0),
        ],
        origins=[
            pb.Origin(
                name="o-us",
                base_url="http://o-us.example/v1",
                region="us-east",
                models=models,
                weight=weight,
                healthy=True,
            ),
            pb.Origin(
                name="o-eu",
                base_url="http://o-eu.example/v1",
                region="eu-west",
                models=models,
                weight=100,
                healthy=True,
            ),
        ],
    )
    t.etag = content_etag(t)
    return t


def saved(state_dir: Path) -> pb.RouteTable:
    t = pb.RouteTable()
    t.ParseFromString((state_dir / TABLE_FILE).read_bytes())
    return t


def test_new_holder_serves_nothing(tmp_path: Path) -> None:
    holder = TableHolder("us-east", tmp_path)
    assert holder.routes is None
    assert holder.source == "none"
    assert holder.load_saved() is False
    assert holder.routes is None


def test_apply_from_control_plane(tmp_path: Path) -> None:
    holder = TableHolder("eu-west", tmp_path)
    assert holder.apply(table(5), CP) is True
    assert holder.routes is not None
    assert holder.routes.version == 5
    assert holder.routes.region == "eu-west"
    assert [t.name for t in holder.routes.candidates("llama-3")] == ["o-eu", "o-us"]
    assert holder.source == CP
    assert holder.received_at > 0


def test_applied_table_is_saved_and_reloaded(tmp_path: Path) -> None:
    first = TableHolder("us-east", tmp_path)
    first.apply(table(5), CP)
    assert saved(tmp_path) == table(5)

    second = TableHolder("us-east", tmp_path)
    assert second.load_saved() is True
    assert second.source == "disk"
    assert second.routes is not None
    assert second.routes.version == 5
    assert second.routes.etag == table(5).etag
    assert [t.name for t in second.routes.candidates("llama-3")] == ["o-us", "o-eu"]


def test_a_saved_tables_age_goes_on_from_when_it_was_saved(tmp_path: Path) -> None:
    """Before (trial 49): a proxy restarted without its control plane counted
    ponto_route_table_age_seconds from its start, as if the table were new."""
    TableHolder("us-east", tmp_path).apply(table(5), CP)
    sent = 1_700_000_000.0
    os.utime(tmp_path / TABLE_FILE, (sent, sent))
    restarted = TableHolder("us-east", tmp_path)
    assert restarted.load_saved() is True
    assert restarted.received_at == sent


def test_newer_table_overwrites_saved_one(tmp_path: Path) -> None:
    holder = TableHolder("us-east", tmp_path)
    holder.apply(table(5), CP)
    holder.apply(table(6, weight=7), CP)
    assert saved(tmp_path) == table(6, weight=7)
    restarted = TableHolder("us-east", tmp_path)
    assert restarted.load_saved() is True
    assert restarted.routes is not None and restarted.routes.version == 6


def test_disk_table_is_not_written_back(tmp_path: Path) -> None:
    holder = TableHolder("us-east", tmp_path)
    holder.apply(table(5), "disk")
    assert not (tmp_path / TABLE_FILE).exists()


def test_no_state_dir(tmp_path: Path) -> None:
    holder = TableHolder("us-east", None)
    assert holder.apply(table(5), CP) is True
    assert holder.load_saved() is False
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "content",
    [b"\xff\xfe garbage \x00\x01", b"", b"\x08\x05"],
    ids=["garbage", "empty", "version-only"],
)
def test_corrupt_saved_file_ignored(tmp_path: Path, content: bytes) -> None:
    (tmp_path / TABLE_FILE).write_bytes(content)
    holder = TableHolder("us-east", tmp_path)
    assert holder.load_saved() is False
    assert holder.routes is None
    assert holder.source == "none"


def test_tampered_saved_file_ignored(tmp_path: Path) -> None:
    t = table(5)
    t.origins[0].base_url = "http://evil.example/v1"  # etag no longer matches
    (tmp_path / TABLE_FILE).write_bytes(t.SerializeToString())
    holder = TableHolder("us-east", tmp_path)
    assert holder.load_saved() is False
    assert holder.routes is None


def test_saved_directory_instead_of_file_ignored(tmp_path: Path) -> None:
    (tmp_path / TABLE_FILE).mkdir()
    holder = TableHolder("us-east", tmp_path)
    assert holder.load_saved() is False
    assert holder.routes is None


def test_invalid_table_keeps_previous_routes(tmp_path: Path) -> None:
    holder = TableHolder("us-east", tmp_path)
    holder.apply(table(5), CP)
    before = holder.routes
    bad = table(6, models=())
    with pytest.raises(TableError):
        holder.apply(bad, CP)
    assert holder.routes is before
    assert saved(tmp_path) == table(5)

    damaged = table(7)
    damaged.etag = "0" * 64
    with pytest.raises(TableError):
        holder.apply(damaged, CP)
    assert holder.routes is before


def test_stale_table_from_control_plane_refused(tmp_path: Path) -> None:
    holder = TableHolder("us-east", tmp_path)
    holder.apply(table(9), CP)
    before = holder.routes
    with pytest.raises(TableError, match="stale"):
        holder.apply(table(8, weight=5), CP)
    assert holder.routes is before
    assert saved(tmp_path) == table(9)


def test_lower_version_accepted_over_disk_table(tmp_path: Path) -> None:
    """A table loaded from disk is replaced by whatever the control plane sends."""
    holder = TableHolder("us-east", tmp_path)
    holder.apply(table(9), "disk")
    assert holder.apply(table(8, weight=5), CP) is True
    assert holder.routes is not None and holder.routes.version == 8
    assert holder.source == CP


def test_same_etag_new_version_updates_version_only(tmp_path: Path) -> None:
    holder = TableHolder("us-east", tmp_path)
    holder.apply(table(5), CP)
    assert holder.apply(table(6), CP) is False
    assert holder.routes is not None
    assert holder.routes.version == 6
    assert holder.routes.etag == table(5).etag


def test_same_table_again_is_no_change(tmp_path: Path) -> None:
    holder = TableHolder("us-east", tmp_path)
    holder.apply(table(5), CP)
    before = holder.routes
    assert holder.apply(table(5), CP) is False
    assert holder.routes is before


def test_control_plane_confirms_disk_table(tmp_path: Path) -> None:
    holder = TableHolder("us-east", tmp_path)
    holder.apply(table(5), "disk")
    assert holder.apply(table(5), CP) is False
    assert holder.source == CP


def test_same_etag_older_version_does_not_reopen_stale_window(tmp_path: Path) -> None:
    """Content A at v7, B at v8, A again at v9: after serving v9, B (v8) is stale.

    A lagging replica may resend A as v7 before pushing v8; accepting v7 must not
    lower the version the stale check compares against.
    """
    holder = TableHolder("us-east", tmp_path)
    holder.apply(table(9), CP)
    assert holder.apply(table(7), CP) is False  # same content, older version
    assert holder.routes is not None
    assert holder.routes.version == 9, "serving version went backwards"
    with pytest.raises(TableError, match="stale"):
        holder.apply(table(8, weight=5), CP)
    assert holder.routes.etag == table(9).etag
