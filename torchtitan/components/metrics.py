"""Throughput, MFU, memory and loss reporting: the console line and TensorBoard."""

from __future__ import annotations

import os
import re
import resource
import sys
import time

import torch

from torchtitan.config.job_config import JobConfig
from torchtitan.tools.logging import logger

# Set by the launcher to "1" when its own console is a terminal: a rank's stderr is a pipe
# to torchrun even then.
COLOR_ENV = "TORCHTITAN_COLOR"


def console_is_terminal() -> bool:
    """Whether log lines end up on a terminal (colour codes in a log file are noise)."""
    if COLOR_ENV in os.environ:
        return os.environ[COLOR_ENV] == "1"
    return sys.stderr.isatty()


# Dense bf16 peak TFLOP/s per accelerator (vendor datasheets, no sparsity).
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,  # SXM; PCIe variants are slower but share the name prefix
    "A100": 312.0,
    "B200": 2250.0,
    "L40S": 362.0,
    "MI300X": 1307.0,
}


def peak_tflops(device_type: str, cpu_peak_tflops: float) -> float:
    """Peak TFLOP/s of this rank's device; on CPU the configured `metrics.cpu_peak_tflops`."""
    if device_type != "cuda":
        return cpu_peak_tflops
    name = torch.cuda.get_device_name()
    for key, value in PEAK_TFLOPS.items():
        if key in name:
            return value
    logger.warning(f"unknown GPU {name!r}: assuming A100 peak for MFU")
    return PEAK_TFLOPS["A100"]


class MemoryMonitor:
    """Peak memory of this rank since the last reset: device peak on GPU; on CPU the process's
    peak RSS (Linux VmHWM, reset through /proc/self/clear_refs, so each logged step reports
    its own peak; elsewhere the lifetime peak)."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        if device_type == "cuda":
            self.capacity = torch.cuda.get_device_properties(
                torch.cuda.current_device()
            ).total_memory
        else:
            self.capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def peak_bytes(self) -> int:
        if self.device_type == "cuda":
            return torch.cuda.max_memory_reserved()
        try:
            with open("/proc/self/status") as f:
                hwm = re.search(r"VmHWM:\s+(\d+)", f.read())
        except OSError:
            hwm = None
        if hwm is None:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return int(hwm.group(1)) * 1024

    def reset_peak(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError:
            pass


class MetricsProcessor:
    """Counts tokens between log steps and prints the step line on rank 0."""

    def __init__(
        self,
        job_config: JobConfig,
        device_type: str,
        flops_per_token: int,
        ranks_per_sample_stream: int,
        rank: int,
    ):
        cfg = job_config.metrics
        self.flops_per_token = flops_per_token
        self.ranks_per_sample_stream = ranks_per_sample_stream
        self.peak_flops = peak_tflops(device_type, cfg.cpu_peak_tflops) * 1e12
        self.memory = MemoryMonitor(device_type)
        self.color = not cfg.disable_color_printing and console_is_terminal()
        self.is_logging_rank = rank == 0
        self.tokens_since_log = 0
        self.time_last_log = time.perf_counter()
        self.writer = None
        if cfg.enable_tensorboard and self.is_logging_rank:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(
                os.path.join(job_config.job.dump_folder, cfg.save_tb_folder)
            )

    def count_tokens(self, n: int) -> None:
        self.tokens_since_log += n

    def log(
        self, step: int, loss: float, max_loss: float, grad_norm: float, lr: float
    ) -> dict[str, float]:
        elapsed = time.perf_counter() - self.time_last_log
        tps = self.tokens_since_log / elapsed / self.ranks_per_sample_stream
        tflops = self.flops_per_token * tps / 1e12
        mfu = 100 * self.flops_per_token * tps / self.peak_flops
        peak = self.memory.peak_bytes()
        mem_gib, mem_pct = peak / 2**30, 100 * peak / self.memory.capacity
        metrics = {
            "loss_metrics/global_avg_loss": loss,
            "loss_metrics/global_max_loss": max_loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "throughput(tps)": tps,
            "tflops": tflops,
            "mfu(%)": mfu,
            "memory/peak_GiB": mem_gib,
        }
        if self.is_logging_rank:
            c = _Colors(self.color)
            logger.info(
                f"{c.red}step: {step:2}  {c.green}loss: {loss:7.4f}  "
                f"{c.yellow}memory: {mem_gib:5.2f}GiB({mem_pct:.2f}%)  "
                f"{c.blue}tps: {round(tps):,}  {c.cyan}tflops: {tflops:,.2f}  "
                f"{c.magenta}mfu: {mfu:.2f}%{c.reset}"
            )
            if self.writer is not None:
                for key, value in metrics.items():
                    self.writer.add_scalar(key, value, step)
                self.writer.flush()
        self.tokens_since_log = 0
        self.time_last_log = time.perf_counter()
        self.memory.reset_peak()
        return metrics

    def log_collectives(self, step: int, counts: dict[str, int]) -> None:
        """The collectives of one step, by kind (tools/collectives.py)."""
        if not self.is_logging_rank:
            return
        from torchtitan.tools.collectives import summary

        logger.info(f"step {step}: {summary(counts)}")
        if self.writer is not None:
            self.writer.add_scalar("comm/collectives", sum(counts.values()), step)
            for kind, n in counts.items():
                self.writer.add_scalar(f"comm/{kind}", n, step)
            for kind, n in getattr(counts, "sent_elements", {}).items():
                self.writer.add_scalar(f"comm_elements/{kind}", n, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class _Colors:
    red: str
    green: str
    yellow: str
    blue: str
    magenta: str
    cyan: str
    reset: str

    def __init__(self, enabled: bool):
        codes = dict(red=31, green=32, yellow=33, blue=34, magenta=35, cyan=36, reset=0)
        for name, code in codes.items():
            setattr(self, name, f"\033[{code}m" if enabled else "")
