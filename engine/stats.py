"""Engine statistics hooks. The engine reports; sinks (the server's Prometheus exporter) record.

The engine never imports prometheus_client: it calls a :class:`StatsSink` from its worker thread.
Sinks must be cheap and thread-safe.
"""

from __future__ import annotations

from typing import Protocol

from .request import TokenEvent


class StatsSink(Protocol):
    def spec_step(self, drafter: str | None, num_draft: int, num_accepted: int,
                  expected_accepted: float, num_committed: int) -> None:
        """One verify step: ``drafter`` None for a plain decode step (no draft);
        ``expected_accepted`` is the scheduler's estimate for the kept draft (calibration)."""

    def batch_step(self, num_sequences: int, num_committed: int) -> None:
        """One batched target pass over ``num_sequences`` decoding sequences (continuous
        batching), committing ``num_committed`` tokens in all (each sequence's verify step is also
        reported through :meth:`spec_step`)."""

    def request_finished(self, event: TokenEvent) -> None:
        """The last event of a request (finish_reason, usage, timings, stats)."""

    def request_rejected(self, reason: str) -> None:
        """A request refused before it reached the worker (queue full, bad input)."""


class NullSink:
    def spec_step(self, drafter, num_draft, num_accepted, expected_accepted, num_committed) -> None:
        pass

    def batch_step(self, num_sequences, num_committed) -> None:
        pass

    def request_finished(self, event) -> None:
        pass

    def request_rejected(self, reason) -> None:
        pass


class FanoutSink:
    """Forward to several sinks (e.g. Prometheus plus a test recorder)."""

    def __init__(self, *sinks: StatsSink):
        self.sinks = list(sinks)

    def spec_step(self, *args) -> None:
        for s in self.sinks:
            s.spec_step(*args)

    def batch_step(self, *args) -> None:
        for s in self.sinks:
            s.batch_step(*args)

    def request_finished(self, event) -> None:
        for s in self.sinks:
            s.request_finished(event)

    def request_rejected(self, reason) -> None:
        for s in self.sinks:
            s.request_rejected(reason)
