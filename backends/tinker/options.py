"""The Tinker backend's settings: the fields of its recipe table (tinker_config.Tinker), defined once.

tinker_config.py makes the backend (`Tinker.make` imports backend.py lazily, and with it the SDK); backend.py types its
settings with this struct instead of importing tinker_config.py back, so the modules form no circle (tests/
test_import_graph.py). `Tinker` is this struct plus the backend's table methods. Light: neither the SDK nor torch.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta


class TinkerOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    # None: $TINKER_BASE_URL, else the SDK's default (hosted service). The API key comes from
    # $TINKER_API_KEY only and is never written anywhere.
    base_url: str | None = None
    # Lifetime of periodic checkpoints on the service (its limits: 1 hour to 10 years); the final
    # checkpoint never expires. Not optional: TOML has no null, so `show` could not write None back.
    ttl_seconds: Annotated[int, Meta(ge=3600, le=10 * 365 * 24 * 3600)] = 7 * 24 * 3600

    # A service never reached fails the run after this long, with one line (the SDK alone retries for ~6 min).
    connect_timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    # Once connected: while calls wait and the service has not answered a ping for this long, the run stops
    # with one line (the SDK alone retries each request for ~5 min, one after another).
    lost_after_s: Annotated[float, Meta(gt=0)] = 60.0
