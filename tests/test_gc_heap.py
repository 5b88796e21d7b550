"""The serving process's start-up heap is kept out of the garbage collector's walks."""

import gc

from kvmem.engine.gc_heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.links: list[Node] = []


def test_freezing_keeps_objects_alive_now_out_of_later_collections():
    built = Node()  # what start-up built: tracked, so a full collection walks it
    try:
        assert gc.is_tracked(built) and any(o is built for o in gc.get_objects())
        frozen = freeze_startup_heap()
        # frozen objects that die later leave the count (other threads of the test
        # process may drop some meanwhile); nothing joins it but by another freeze
        assert 0 < gc.get_freeze_count() <= frozen
        assert not any(o is built for o in gc.get_objects())  # no generation walks it
        cycle = Node()
        cycle.links.append(cycle)
        alive = gc.get_objects()
        assert any(o is cycle for o in alive)  # what serving allocates is still walked
        del cycle, alive
        assert gc.collect() > 0  # and its garbage still collected
    finally:
        gc.unfreeze()
    assert any(o is built for o in gc.get_objects())
