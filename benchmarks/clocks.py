"""Run id and GPU clock / power sampling shared by every benchmark script.

Every result record carries:

- ``run``: one id for all records of one process (the UTC start time, ISO format), or
  ``$JCM_RUN_ID`` when set, so several scripts of one device call share it and a report
  can tell figures measured side by side from figures of different calls (the card's
  clock, and so every figure, moves between calls);
- ``sm_clock_mhz`` / ``power_w``: medians of the SM clock and board power sampled every
  100 ms by a background thread over that record's timing windows (``None`` where no
  sampler is available: no pynvml and no ``nvidia-smi``, e.g. a CPU machine).

The sampler reads NVML through ``pynvml`` when it imports and initialises, else polls
``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader,nounits
-lms 100``; it watches the GPU ``$JCM_GPU_INDEX`` (default: the first entry of
``$CUDA_VISIBLE_DEVICES`` when numeric, else 0).

>>> rid = run_id(); rid == run_id()
True
>>> fields = summary([])
>>> sorted(fields), fields["sm_clock_mhz"] is None
(['power_w', 'sm_clock_mhz'], True)
"""
from __future__ import annotations

import atexit
import datetime as _dt
import os
import shutil
import statistics
import subprocess
import threading
import time

_START = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
PERIOD_S = 0.1


def run_id() -> str:
    """``$JCM_RUN_ID`` if set, else this process's UTC start time (ISO 8601)."""
    return os.environ.get("JCM_RUN_ID") or _START


def gpu_index() -> int:
    env = os.environ.get("JCM_GPU_INDEX")
    if env is not None:
        return int(env)
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


class Sampler:
    """Background sampling of (wall time, SM clock MHz, power W); ``source`` says how
    (``"pynvml"``, ``"nvidia-smi"`` or ``None`` when nothing can be sampled)."""

    def __init__(self, index: int | None = None, sources=("pynvml", "nvidia-smi")):
        self.index = gpu_index() if index is None else index
        self.samples: list[tuple[float, float, float | None]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._proc = None
        self.source = None
        self.error = None
        target = None
        for src in sources:
            target = target or {"pynvml": self._nvml_target,
                                "nvidia-smi": self._smi_target}[src]()
        if target is not None:
            threading.Thread(target=target, daemon=True, name="gpu-clock-sampler").start()

    # -- sources ------------------------------------------------------------------------
    def _nvml_target(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
        except Exception as e:  # noqa: BLE001 - no NVML: fall back to nvidia-smi
            self.error = f"pynvml: {type(e).__name__}: {e}"
            return None
        self.source = "pynvml"

        def loop():
            while not self._stop.is_set():
                try:
                    mhz = float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
                    try:
                        watts = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
                    except Exception:  # noqa: BLE001 - power is optional on some boards
                        watts = None
                    self._add(time.time(), mhz, watts)
                except Exception as e:  # noqa: BLE001
                    self.error = f"pynvml: {type(e).__name__}: {e}"
                self._stop.wait(PERIOD_S)
        return loop

    def _smi_target(self):
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return None
        cmd = [exe, "-i", str(self.index),
               "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
               "-lms", str(int(PERIOD_S * 1000))]
        # Line-buffered output where stdbuf exists: a pipe would otherwise be block-buffered
        # and samples would arrive seconds late (their own timestamps keep them placed).
        if shutil.which("stdbuf"):
            cmd = ["stdbuf", "-oL"] + cmd
        try:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)
        except OSError as e:
            self.error = f"nvidia-smi: {e}"
            return None
        self.source = "nvidia-smi"
        atexit.register(self.close)

        def loop():
            for line in self._proc.stdout:
                parsed = parse_smi_line(line, time.time())
                if parsed is not None:
                    self._add(*parsed)
                if self._stop.is_set():
                    break
        return loop

    def _add(self, t, mhz, watts):
        with self._lock:
            self.samples.append((t, mhz, watts))

    # -- reading ------------------------------------------------------------------------
    def summary(self, windows) -> dict:
        """Medians of the samples inside any of ``windows`` ([(t0, t1)] wall times)."""
        if self.source is None or not windows:
            return {"sm_clock_mhz": None, "power_w": None}
        end = max(t1 for _, t1 in windows)
        deadline = time.time() + 4 * PERIOD_S + 1.0    # let the last samples arrive
        while time.time() < deadline:
            with self._lock:
                if self.samples and self.samples[-1][0] >= end:
                    break
            time.sleep(PERIOD_S / 2)
        with self._lock:
            inside = [s for s in self.samples if any(t0 <= s[0] <= t1 for t0, t1 in windows)]
        if not inside:     # windows shorter than the period: the nearest sample
            with self._lock:
                if not self.samples:
                    return {"sm_clock_mhz": None, "power_w": None}
                mid = sum(t0 + t1 for t0, t1 in windows) / (2 * len(windows))
                inside = [min(self.samples, key=lambda s: abs(s[0] - mid))]
        watts = [s[2] for s in inside if s[2] is not None]
        return {"sm_clock_mhz": round(statistics.median(s[1] for s in inside), 1),
                "power_w": round(statistics.median(watts), 1) if watts else None}

    def close(self):
        self._stop.set()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self._proc.kill()


def parse_smi_line(line: str, now: float):
    """(time, MHz, W) of one ``timestamp, clocks.sm, power.draw`` line, or None.

    The timestamp nvidia-smi prints (local time) places the sample; ``now`` stands in when
    it does not parse. Power reads "[N/A]" on some boards (kept as None).

    >>> parse_smi_line("2026/12/01 10:27:32.100, 1755, 512.34", 0.0)[1:]
    (1755.0, 512.34)
    >>> parse_smi_line("2026/12/01 10:27:32.100, 1755, [N/A]", 0.0)[1:]
    (1755.0, None)
    >>> parse_smi_line("garbage", 0.0) is None
    True
    """
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3:
        return None
    try:
        mhz = float(parts[1])
    except ValueError:
        return None
    try:
        watts = float(parts[2])
    except ValueError:
        watts = None
    try:
        t = _dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
    except ValueError:
        t = now
    return t, mhz, watts


_SAMPLER: Sampler | None = None


def sampler() -> Sampler:
    """The process's sampler, started on first use (before the first timing window)."""
    global _SAMPLER
    if _SAMPLER is None:
        _SAMPLER = Sampler()
    return _SAMPLER


def start() -> Sampler:
    return sampler()


def summary(windows) -> dict:
    """``{"sm_clock_mhz", "power_w"}`` medians over ``windows``; None without a sampler.

    With no windows it does not start a sampler."""
    if not windows:
        return {"sm_clock_mhz": None, "power_w": None}
    return sampler().summary(windows)


def fields(windows) -> dict:
    """The measurement fields every record carries: run id, clock and power medians."""
    return {"run": run_id(), **summary(windows)}
