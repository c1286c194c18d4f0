"""What a pipeline schedule adds to its stages' own times and memory.

The auto-parallel planner plans each pipeline stage as a module of its own, for one
microbatch on the ranks of its stage (its predicted step: forward, backward and its own
collectives once).
A schedule of `torch.distributed.pipelining` runs `m` microbatches through `p` pipeline
ranks, each holding `v` stages (1 for GPipe and 1F1B, 2 or more for the interleaved and
zero-bubble ones).  This module prices what that adds, from the schedule's shape alone:

* time — the steady state runs at the slowest rank (`T`, its stages' times per
  microbatch added up); filling and draining the pipeline leaves each rank idle for
  `(p - 1) / v` of `T` (the bubble); the first microbatch's activations and the last one's
  gradients cross every stage boundary on the critical path (`2 (p v - 1)` sends):
  `step = m T + (p - 1) T / v + 2 (p v - 1) s`.  The zero-bubble schedules are priced like
  the interleaved ones: the credit for splitting backward into input and weight
  gradients is not taken (an upper bound);
* memory — how many microbatches' activations a stage holds at once at its peak (GPipe
  and LoopedBFS all of them; 1F1B `p - r` on pipeline rank `r`; the interleaved and
  zero-bubble schedules what their warm-up holds, spread over the rank's stages), as
  torch's schedules order their operations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# schedules that run every forward before any backward (all microbatches in flight)
_ALL_FORWARDS_FIRST = ("GPipe", "LoopedBFS")


@dataclass(frozen=True)
class PipelineShape:
    """A schedule on `pp` pipeline ranks, each holding `stages_per_rank` stages, running
    `microbatches` microbatches per step."""

    schedule: str
    pp: int
    stages_per_rank: int
    microbatches: int

    def in_flight(self, pp_rank: int) -> float:
        """Microbatches whose activations each stage of pipeline rank `pp_rank` keeps at
        its peak (what its one-microbatch plan saves for backward, this many times): the
        most stage-microbatches the rank holds at once in torch's order of operations, over
        its stages (tests/unit_tests/test_pipeline_cost.py reads them from torch)."""
        m, p, v, r = self.microbatches, self.pp, self.stages_per_rank, pp_rank
        if not 0 <= r < p:
            raise ValueError(f"pipeline rank {r} of {p}")
        if self.schedule in _ALL_FORWARDS_FIRST:
            held = v * m
        elif v == 1:  # 1F1B: the warm-up's forwards, one per rank below, and one more
            held = min(m, p - r)
        elif self.schedule == "ZBVZeroBubble":
            held = min(2 * p, m + 1 + r, 2 * m)
        elif self.schedule == "InterleavedZeroBubble":
            held = v * min(p, m)
        else:  # Interleaved1F1B: (v - 1) rounds of p forwards, two per rank below, one more
            held = min(v * m, (v - 1) * p + 2 * (p - 1 - r) + 1)
        return held / v

    def step_us(self, rank_us: list[float], send_us: float) -> float:
        """The step time given each pipeline rank's time for one microbatch through all
        its stages (forward and backward) and one stage-to-stage send."""
        return self.steady_us(rank_us) + self.bubble_us(rank_us) + self.sends_us(send_us)

    def steady_us(self, rank_us: list[float]) -> float:
        return self.microbatches * max(rank_us)

    def bubble_us(self, rank_us: list[float]) -> float:
        return (self.pp - 1) * max(rank_us) / self.stages_per_rank

    def sends_us(self, send_us: float) -> float:
        """The sends on the critical path: the first microbatch forward through every
        stage boundary, the last one's gradient back."""
        return 2 * (self.pp * self.stages_per_rank - 1) * send_us


def send_us(nbytes: float, latency_us: float, bw_gbps: float) -> float:
    """One point-to-point send of `nbytes` over a link."""
    return latency_us + nbytes / (bw_gbps * 1e3) if nbytes else 0.0


def bubble_fraction(shape: PipelineShape) -> float:
    """The share of a step a rank idles while the pipeline fills and drains (no sends)."""
    m, p, v = shape.microbatches, shape.pp, shape.stages_per_rank
    return (p - 1) / v / (m + (p - 1) / v) if m else math.nan
