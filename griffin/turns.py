"""Generations that share a target model take turns, one thread at a time.

A generation switches the target's linear layers to small-input kernels, fills one reusable KV buffer and advances a
shared drafter: two threads doing that at once on one model corrupt each other (a layer switched back under the other
thread's feet). :func:`turn` serialises them per target model; the thread holding the turn may re-enter it (a
tuning run inside a generation, or several streams interleaved by one thread).
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn


class Turns:
    """A lock that the thread holding it may take again (like ``threading.RLock``), and that any thread may hand
    back: a stream abandoned by its thread is closed by the garbage collector, possibly in another thread."""

    def __init__(self):
        self._free = threading.Condition()
        self._owner: int | None = None
        self._depth = 0

    @contextmanager
    def held(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._free:
            self._free.wait_for(lambda: self._owner in (None, me))
            self._owner, self._depth = me, self._depth + 1
        try:
            yield
        finally:
            with self._free:
                self._depth -= 1
                if not self._depth:
                    self._owner = None
                    self._free.notify_all()


_TURNS: weakref.WeakKeyDictionary[nn.Module, Turns] = weakref.WeakKeyDictionary()
_MADE = threading.Lock()  # two threads asking for a model's turns first at once must get the same object


def turn(model: nn.Module):
    """``with turn(model):`` waits until no other thread is generating with ``model``, and holds it meanwhile."""
    with _MADE:
        turns = _TURNS.get(model)
        if turns is None:
            turns = _TURNS[model] = Turns()
    return turns.held()


def one_thread_at_a_time(method: Callable) -> Callable:
    """Decorate a method of an object with a ``target`` model (a generation, or a stream of one) to run in
    :func:`turn` of that model; a stream holds the turn until it is exhausted or closed."""
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def stream(self, *args, **kwargs):
            with turn(self.target):
                yield from method(self, *args, **kwargs)

        return stream

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with turn(self.target):
            return method(self, *args, **kwargs)

    return call
