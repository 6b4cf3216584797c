"""The collector settles where the service says, and every collection is accounted."""

import gc
import weakref

import pytest

from flodl_coordinator.gcsettle import SETTLE_ON, CollectorSettle


@pytest.fixture
def settle():
    s = CollectorSettle()
    gc.disable()  # only the collections each test asks for
    yield s
    gc.enable()
    s.uninstall()
    gc.unfreeze()  # (the test process's objects go back to the collector)


class _Cycle:
    def __init__(self):
        self.me = self


def test_a_settle_collects_then_freezes_only_when_a_world_formed_or_an_epoch_aggregated(settle):
    assert SETTLE_ON == {"world_formed", "epoch"}
    settle.notice("window")  # a window's decision: not a settle
    settle.settle()
    assert settle.settles == 0 and gc.get_freeze_count() == 0
    dead = weakref.ref(_Cycle())  # garbage in a cycle: a settle collects it before freezing, never freezes it
    assert dead() is not None  # (only the cyclic collector can free it)
    settle.notice("world_formed")
    assert settle.due
    settle.settle()
    assert not settle.due and settle.settles == 1
    frozen = gc.get_freeze_count()
    assert frozen > 0
    assert dead() is None  # collected, not frozen
    settle.settle()  # not due again until the next notice
    assert settle.settles == 1
    settle.notice("epoch")
    settle.settle()
    after = gc.get_freeze_count()
    assert settle.settles == 2 and after >= frozen
    st = settle.stats()
    # (Frozen objects can still be freed -- by another thread too: the count only falls
    # until the next freeze, so two reads need not be equal; a suite run saw 20 go.)
    assert st["gc_settles"] == 2 and 0 < st["gc_frozen"] <= after
    assert st["gc_settle_s"] >= 0.0 and st["gc_settle_max_ms"] >= 0.0


def test_collections_are_counted_by_generation_while_installed_and_a_settle_is_not_one(settle):
    settle.install()
    settle.install()  # idempotent: one callback
    assert gc.callbacks.count(settle._on_gc) == 1
    gc.collect(0)
    gc.collect(2)
    assert settle.collections[0] >= 1 and settle.collections[2] >= 1
    before = list(settle.collections)
    settle.notice("epoch")
    settle.settle()  # its own collection is the settle's, not the collector's
    assert settle.collections == before and settle.settles == 1
    assert settle.stats()["gc_max_ms"] >= 0.0 and settle.stats()["gc_s"] >= 0.0
    settle.uninstall()
    assert settle._on_gc not in gc.callbacks
    gc.collect(2)
    assert settle.collections == before


def test_a_deferred_collector_collects_nothing_until_resumed_then_at_once():
    # A pass defers the collector so its sends go first (gcsettle's module doc): while
    # deferred, far more allocations than a young collection's threshold collect nothing;
    # resumed, the collection that became due runs at the next allocations.
    s = CollectorSettle()
    old = gc.get_threshold()
    gc.enable()
    gc.set_threshold(100, 10, 10)
    try:
        held = s.defer()
        assert held and not gc.isenabled()
        dead = weakref.ref(_Cycle())  # cyclic garbage: only a collection frees it
        junk = [[] for _ in range(5000)]
        assert dead() is not None
        s.resume(held)
        assert gc.isenabled()
        more = [[] for _ in range(500)]
        assert dead() is None
        del junk, more
        gc.disable()  # already off (nested, or someone else's): defer leaves it so, and resume too
        assert s.defer() is False
        s.resume(False)
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.set_threshold(*old)


def test_a_service_pass_defers_the_collector_and_gives_it_back_even_when_it_raises():
    # The main-thread service (``_gc_settling``) holds the collector through a pass; a
    # nested pass leaves that to the outer one; a pass that raises still gives it back;
    # a service in another thread (an embedding's, the tests') leaves it alone.
    from flodl_coordinator.service import CoordinatorService
    from flodl_coordinator.settings import load_settings

    svc = CoordinatorService(load_settings(env={}, flags={
        "world_size": 2, "bind": "tcp://127.0.0.1:0", "session": "gc", "epochs": 1, "batch_size": 4,
    }), ready=lambda ep: None)  # fmt: skip
    gc.enable()
    try:
        svc._gc_settling = True  # (what run() sets on the main thread)
        with pytest.raises(RuntimeError, match="mid-pass"):
            with svc._pass():
                assert not gc.isenabled()
                with svc._pass():
                    assert not gc.isenabled()
                assert not gc.isenabled()
                raise RuntimeError("mid-pass")
        assert gc.isenabled() and svc._outbox is None
        svc._gc_settling = False
        with svc._pass():
            assert gc.isenabled()
    finally:
        gc.enable()
        svc._wake_r.close()
        svc._wake_w.close()
