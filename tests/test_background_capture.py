"""The background capture planner (engine/capture.py): order and pacing."""

import pytest

from raygraph.config import GraphConfig
from raygraph.engine.capture import BackgroundCapture
from raygraph.protocol import BucketKey

SHARE = GraphConfig().capture_share

D = [BucketKey("decode", n) for n in (1, 2, 4, 8)]
P = [BucketKey("prefill", n) for n in (16, 512, 2048)]


def test_without_traffic_decode_first_small_before_large():
    bg = BackgroundCapture(list(reversed(P + D)), SHARE)  # the start-up schedule: largest first
    order = []
    while not bg.done:
        key = bg.next_key()
        order.append(key)
        bg.captured_key(key, 0.1)
    assert order == D + P
    assert bg.captured == bg.total == 7 and bg.finished_at is not None


def test_traffic_moves_keys_up_the_queue():
    bg = BackgroundCapture(D + P, SHARE)
    for _ in range(3):
        bg.missed(BucketKey("decode", 8))
    bg.missed(BucketKey("prefill", 2048))
    assert bg.next_key() == BucketKey("decode", 8)
    bg.captured_key(BucketKey("decode", 8), 0.1)
    assert bg.next_key() == BucketKey("prefill", 2048)
    bg.captured_key(BucketKey("prefill", 2048), 0.1)
    assert bg.next_key() == BucketKey("decode", 1)  # then the schedule's order
    assert bg.eager_steps == 4


def test_a_key_outside_the_schedule_joins_it():
    bg = BackgroundCapture([BucketKey("decode", 4, 4)], SHARE)
    extra = BucketKey("decode", 4, 8)  # EP: an unbalanced pair of DP loads
    bg.missed(extra)
    assert bg.total == 2 and bg.next_key() == extra
    bg.captured_key(extra, 0.1)
    bg.captured_key(BucketKey("decode", 4, 4), 0.1)
    assert bg.done and not bg.due(busy=False)


def test_under_load_capture_takes_its_share_of_the_time():
    bg = BackgroundCapture(D, share=0.25)
    assert bg.due(busy=True, now=0.0) and bg.due(busy=False, now=0.0)
    bg.captured_key(D[0], 1.0, now=10.0)  # 1 s of capture: 3 s of steps before the next
    assert not bg.due(busy=True, now=12.9)
    assert bg.due(busy=True, now=13.0)
    assert bg.due(busy=False, now=10.5)  # idle: capture back to back


def test_share_must_be_a_fraction():
    for bad in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match="share"):
            BackgroundCapture(D, share=bad)


def test_a_failed_background_capture_makes_requests_wait_for_the_restart():
    """A background capture that fails (a rank died) tears the group down, and the step
    thread then restarts it: requests arriving meanwhile must wait (`recovering`), not be
    refused as "not serving". A failed capture at start (no restart follows) does not."""
    import types

    from raygraph.config import ServeConfig
    from raygraph.engine.capture import Capture
    from raygraph.engine.engine import Engine
    from raygraph.engine.lockstep import CaptureError

    def failing(key, call):
        raise CaptureError(f"capture of {key} failed on rank 0: ActorDiedError")

    for recover in (True, False):
        c = object.__new__(Engine)  # the failure hook's own state only
        c.healthy, c.recovering, c.group, c.workers, c.core = True, False, None, [], None
        capture = Capture(ServeConfig(), lambda method, key: [], c._capture_failed, list)
        capture.lockstep = types.SimpleNamespace(capture=failing)
        with pytest.raises(CaptureError):
            capture.capture_key(BucketKey("decode", 2), recover=recover)
        assert not c.healthy and c.recovering is recover
        assert "failed on rank 0" in c.unhealthy_reason
