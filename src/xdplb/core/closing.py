"""The ``with`` statement for objects that hold something to release: one base class,
whose ``__exit__`` calls the object's own ``close``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import Self


class Closing(ABC):
    """A base for classes with a :meth:`close`: ``with obj:`` gives ``obj`` and closes it
    on the way out (an exception still propagates). A class whose ``__enter__`` does more
    (starts something) overrides it and keeps this ``__exit__``."""

    __slots__ = ()

    @abstractmethod
    def close(self) -> None:
        """Release what the object holds."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
