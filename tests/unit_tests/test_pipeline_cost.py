"""What a pipeline schedule adds to its stages (torchtitan/distributed/pipeline_cost.py): the
bubble and sends by hand, and the microbatches in flight against torch's own schedules'
order of operations."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan.distributed.pipeline_cost import PipelineShape, bubble_fraction, send_us


def test_one_stage_per_rank_fills_and_drains_once():
    shape = PipelineShape("1F1B", pp=4, stages_per_rank=1, microbatches=8)
    # 8 microbatches at the slowest rank's 10 us, 3 slots of bubble, 2 x 3 boundary sends
    assert shape.step_us([10.0, 10.0, 8.0, 9.0], 1.0) == 8 * 10 + 3 * 10 + 2 * 3 * 1.0
    assert bubble_fraction(shape) == pytest.approx(3 / 11)


def test_interleaving_divides_the_bubble_and_crosses_more_boundaries():
    shape = PipelineShape("Interleaved1F1B", pp=4, stages_per_rank=2, microbatches=8)
    assert shape.bubble_us([10.0] * 4) == 3 * 10 / 2
    assert shape.sends_us(1.0) == 2 * (8 - 1)
    assert shape.step_us([10.0] * 4, 1.0) == 80 + 15 + 14


def test_a_send_is_latency_plus_bytes_over_bandwidth():
    assert send_us(50e6, latency_us=20.0, bw_gbps=50.0) == pytest.approx(20.0 + 1000.0)
    assert send_us(0, latency_us=20.0, bw_gbps=50.0) == 0.0


def _torch_peak_in_flight(schedule: str, pp: int, microbatches: int) -> dict[int, int]:
    """Per pipeline rank: the most stage-microbatches whose activations it holds at once,
    read from torch's own order of operations (a forward holds one, a full or weight
    backward gives it back)."""
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    cls = get_schedule_class(schedule)
    multi = issubclass(cls, PipelineScheduleMulti)
    ids = [0, 2 * pp - 1] if schedule == "ZBVZeroBubble" else [0, pp] if multi else [0]
    n_stages = pp * len(ids)
    stages = [PipelineStage(torch.nn.Linear(2, 2), s, n_stages, torch.device("cpu")) for s in ids]
    order = cls(stages if multi else stages[0], n_microbatches=microbatches).pipeline_order
    peaks = {}
    for rank, actions in order.items():
        held = peak = 0
        for action in actions:
            kind = str(action).lstrip("0123456789")[:1] if action is not None else ""
            held += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
            peak = max(peak, held)
        peaks[rank] = peak
    return peaks


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_after():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


MULTI = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")


@pytest.mark.parametrize("pp, microbatches", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16)])
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", *MULTI])
def test_microbatches_in_flight_are_what_torch_schedules_hold(schedule, pp, microbatches):
    v = 2 if schedule in MULTI else 1
    shape = PipelineShape(schedule, pp, v, microbatches)
    if dist.is_initialized() and dist.get_world_size() != pp:
        dist.destroy_process_group()
    peaks = _torch_peak_in_flight(schedule, pp, microbatches)
    assert {r: shape.in_flight(r) * v for r in range(pp)} == peaks
