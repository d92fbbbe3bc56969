"""An in-process world: ranks as threads of one process, exchanging objects by queues.

It runs the context-parallel schedules shard by shard in one process (the one-GPU test of
the whole ring against one call; CPU tests of the schedule without any process group).
Arrays are handed over, not copied: a receiver must not write what it received, which the
schedules never do.
"""

from __future__ import annotations

import threading


class LoopbackWorld:
    """``world`` ranks; ``member(rank)`` is rank ``rank``'s communicator (``exchange``,
    ``all_gather``, ``reduce_scatter``, ``all_reduce`` as the schedules use them). Every
    member must make the same calls in the same order, as over a real process group."""

    def __init__(self, world: int, add=None):
        self.world = world
        self._add = add or (lambda a, b: a + b)
        # messages to each rank, by (channel, sender, the sender's message number to it):
        # the n-th receive from a rank on a channel gets the n-th message it sent there (as
        # point-to-point messages between two ranks match in the order they were posted)
        self._inbox = [dict() for _ in range(world)]
        self._arrived = threading.Condition()
        self._barrier = threading.Barrier(world)
        self._slots = [None] * world

    def member(self, rank: int) -> "LoopbackMember":
        return LoopbackMember(self, rank)

    def run(self, fn) -> list:
        """``fn(member)`` on every rank, each in its own thread; their results in rank
        order (the first exception re-raised)."""
        results, errors = [None] * self.world, []

        def body(r):
            try:
                results[r] = fn(self.member(r))
            except BaseException as e:   # noqa: BLE001 - re-raised in the caller
                errors.append(e)
                self._barrier.abort()
                with self._arrived:
                    self._arrived.notify_all()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


class _Received:
    __slots__ = ("world", "rank", "number")

    def __init__(self, world, rank, number):
        self.world, self.rank, self.number = world, rank, number

    def wait(self):
        if self.number is None:
            return None
        w = self.world
        with w._arrived:
            w._arrived.wait_for(lambda: self.number in w._inbox[self.rank] or w._barrier.broken)
            if w._barrier.broken:
                raise threading.BrokenBarrierError
            return w._inbox[self.rank].pop(self.number)


class LoopbackMember:
    def __init__(self, world: LoopbackWorld, rank: int):
        self._world, self.rank, self.world = world, rank, world.world
        self._sent: dict = {}       # (channel, peer) -> messages posted to / from that peer
        self._received: dict = {}

    def exchange(self, dst, arrays, src, like, channel="kv"):
        w = self._world
        if dst is not None:
            n = self._sent.get((channel, dst), 0)
            self._sent[(channel, dst)] = n + 1
            with w._arrived:
                w._inbox[dst][(channel, self.rank, n)] = list(arrays)
                w._arrived.notify_all()
        if src is None:
            return _Received(w, self.rank, None)
        n = self._received.get((channel, src), 0)
        self._received[(channel, src)] = n + 1
        return _Received(w, self.rank, (channel, src, n))

    def _gather_all(self, value) -> list:
        w = self._world
        w._barrier.wait()
        w._slots[self.rank] = value
        w._barrier.wait()
        seen = list(w._slots)
        w._barrier.wait()
        return seen

    def all_gather(self, x) -> list:
        return self._gather_all(x)

    def reduce_scatter(self, parts):
        every = self._gather_all(parts)
        total = every[0][self.rank]
        for p in every[1:]:
            total = self._world._add(total, p[self.rank])
        return total

    def all_reduce(self, x):
        every = self._gather_all(x)
        total = every[0]
        for p in every[1:]:
            total = self._world._add(total, p)
        return total
