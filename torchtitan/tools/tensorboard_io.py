"""Read scalar series back from the TensorBoard event files a run wrote."""

from __future__ import annotations

from pathlib import Path


def read_scalars(tb_dir: str | Path, tag: str = "loss_metrics/global_avg_loss") -> dict[int, float]:
    """step -> value for `tag` over every event file under `tb_dir`.

    A resumed run appends new event files to the same folder; when a step appears more
    than once, the value written last wins.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(Path(tb_dir).rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    series: dict[int, float] = {}
    for file in files:
        acc = EventAccumulator(str(file), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags().get("scalars", []):
            for event in acc.Scalars(tag):
                series[event.step] = event.value
    return dict(sorted(series.items()))
