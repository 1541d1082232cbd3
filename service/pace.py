"""The one pacing rule for bytes a client moves: a body it sends and an answer it reads must
keep up with `min_body_rate` bytes/s on average, counted from the start, once `body_grace_s`
is over; a client slower than that is cut off rather than holding the service's memory for as
long as it keeps its connection open."""

from __future__ import annotations

from dataclasses import dataclass

from .settings import Settings

__all__ = ["Pace"]


@dataclass(frozen=True, slots=True)
class Pace:
    """`min_rate` bytes/s (0: no rule) after `grace_s` seconds."""

    min_rate: float = 0.0
    grace_s: float = 0.0

    @classmethod
    def of(cls, settings: Settings) -> Pace:
        return cls(settings.min_body_rate, settings.body_grace_s)

    def due(self, start: float, done: int) -> float | None:
        """When (on the clock `start` is on) `done` bytes must have moved; None: no rule."""
        if self.min_rate <= 0:
            return None
        return start + self.grace_s + done / self.min_rate
