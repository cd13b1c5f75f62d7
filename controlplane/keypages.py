"""Pages of the Admin API's ListKeys.

Keys are listed in one order, (tenant, creation time, id), none of which a
key ever changes; a page's token names the last key it gave and the filter
it was asked with, and the next page starts after that key. So paging over
keys being created and revoked gives every key that existed throughout
exactly once (one created meanwhile is given if it sorts after the page
being read), and a page costs nothing to remember: the token is the state.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from controlplane.errors import InvalidArgument
from controlplane.model import ApiKeyRecord
from ponto.quota_types import key_scope
from ponto.v1 import admin_pb2 as apb

# An answer of this many keys is about 1.1 MB (some 220 bytes a key with its
# spend), which any client's default 4 MiB receive limit takes; not fewer,
# as every page lists and sorts all the keys again (controlplane.cli's
# KEYS_PAGE).
MAX_PAGE = 5000
# The token's first field (matched in _after): a token of another form is
# refused, not misread.
_FORM = 1


def listing_order(key: ApiKeyRecord) -> tuple[str, float, str]:
    """Where a key is listed (Catalog.list_keys sorts by it)."""
    return (key.tenant, key.created_at, key.id)


@dataclass(frozen=True, slots=True)
class KeyPage:
    """A ListKeys answer's keys, in listing_order, and the token that asks
    for the next page ("" when no key follows)."""

    keys: Sequence[ApiKeyRecord]
    next_token: str


def page_of(
    keys: Sequence[ApiKeyRecord], size: int, token: str, *, tenant: str, include_revoked: bool
) -> KeyPage:
    """The page of `keys` (listed, in listing_order, with the filter `tenant`
    and `include_revoked`) that `size` and `token` ask for: at most `size`
    keys (MAX_PAGE past it; 0, every key left) after the key `token` names.
    InvalidArgument for a negative size, a token this function did not make,
    or one made for another filter (its keys would be another listing's)."""
    if size < 0:
        raise InvalidArgument(f"page_size {size} is negative", field="page_size")
    start = 0
    if token:
        after = _after(token, tenant, include_revoked)
        start = bisect.bisect_right(keys, after, key=listing_order)
    if not size:
        return KeyPage(keys[start:], "")
    end = start + min(size, MAX_PAGE)
    page = keys[start:end]
    more = end < len(keys)
    return KeyPage(page, _token(page[-1], tenant, include_revoked) if more else "")


def spent_of(key_ids: Iterable[str], spent: Iterable[apb.BudgetSpent]) -> list[apb.BudgetSpent]:
    """The rows of `spent` that are the keys' of `key_ids` (scope k/<id>), in
    their order: a page's, or a listing's cut to its active keys."""
    scopes = {key_scope(key_id) for key_id in key_ids}
    return [row for row in spent if row.scope in scopes]


def _token(last: ApiKeyRecord, tenant: str, include_revoked: bool) -> str:
    fields = [_FORM, tenant, include_revoked, *listing_order(last)]
    return base64.urlsafe_b64encode(json.dumps(fields).encode()).decode()


def _after(token: str, tenant: str, include_revoked: bool) -> tuple[str, float, str]:
    try:
        fields = json.loads(base64.urlsafe_b64decode(token.encode("ascii")))
    except (UnicodeEncodeError, binascii.Error, ValueError, RecursionError):
        # RecursionError: lists nested past the interpreter's depth, which
        # only a forged token has; let through, it would be INTERNAL, with a
        # traceback logged, for a client's bad argument.
        fields = None
    match fields:
        case [1, str(of_tenant), bool(of_revoked), str(t), int() | float() as at, str(key_id)] if (
            _finite(at)
        ):
            pass
        case _:
            raise InvalidArgument(
                "page_token is not one ListKeys gave: ask without it for the first page",
                field="page_token",
            )
    if (of_tenant, of_revoked) != (tenant, include_revoked):
        raise InvalidArgument(
            "page_token was given for another tenant or include_revoked: ask each page "
            "with the first page's",
            field="page_token",
        )
    return (t, float(at), key_id)


def _finite(at: float) -> bool:
    """Whether a token's creation time is one a key has: an integer past a
    float's range (OverflowError when compared) and NaN or Infinity (which
    json reads) come from forged tokens only."""
    try:
        return math.isfinite(at)
    except OverflowError:
        return False
