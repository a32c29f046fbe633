"""Run metrics: JSONL + TensorBoard writer, a plain-text progress bar, FLOPs/MFU.

FLOP convention (PaLM, Chowdhery et al. 2022, App. B, with the causal half):
training costs `6·N + 6·L·H·hd·T` FLOPs per token, where N counts every parameter that takes part
in a matmul (all weights except the input-embedding lookup table; the LM head counts even when
tied), L layers, H query heads of size hd, T the sequence length. The attention term is
fwd+bwd (×3) of QKᵀ and AV (2·2·T·hd per head and token) = 12·L·H·hd·T, halved because a causal
token attends to T/2 keys on average. Forward only (generation, log-prob recomputation) is a third
of that: `2·N + 2·L·H·hd·T`. Norms, RoPE, softmax and activations are not counted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

import numpy as np

# Dense peak FLOP/s per device for MFU (vendor datasheets, without sparsity).
PEAK_FLOPS = {
    "h100_bf16": 989e12,  # NVIDIA H100 SXM
    "h200_bf16": 989e12,  # NVIDIA H200 (same compute as H100 SXM)
    "mi300x_bf16": 1307e12,  # AMD Instinct MI300X
    "a100_bf16": 312e12,
}


# -- writer ---------------------------------------------------------------------------------------

def _plain(value: Any) -> Any:
    """Host Python value for JSON: numpy/jax scalars -> float/int, small arrays -> lists."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if hasattr(value, "__array__") or isinstance(value, np.generic):
        array = np.asarray(value)
        if array.ndim == 0:
            return array.item()
        return array.tolist()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


class MetricsWriter:
    """One JSON line per `write` in `<run_dir>/metrics.jsonl` and TensorBoard scalars in `<run_dir>/tb`.

    Each line is flushed as it is written, so a killed run keeps every step it logged; `close` is
    idempotent and also runs on garbage collection / context exit.
    """

    def __init__(self, run_dir: str | pathlib.Path, *, tensorboard: bool = True, jsonl: bool = True,
                 filename: str = "metrics.jsonl"):
        self.run_dir = pathlib.Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / filename if jsonl else None
        self._jsonl = open(self.jsonl_path, "a", buffering=1) if jsonl else None
        self._tb = None
        if tensorboard:
            from rstar_jax.train.tb_events import ScalarEventWriter

            self._tb = ScalarEventWriter(self.run_dir / "tb")
        self.closed = False

    def write(self, step: int, metrics: Mapping[str, Any], *, prefix: str = "") -> dict:
        """Logs `metrics` at `step`; returns the record written. Numeric scalars go to TensorBoard."""
        if self.closed:
            raise RuntimeError("MetricsWriter.write after close()")
        record = {"step": int(step), "time": time.time()}
        for key, value in metrics.items():
            name = f"{prefix}{key}"
            if name in record:
                raise ValueError(f"metric name {name!r} collides with a reserved field")
            record[name] = _plain(value)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            self._tb.add_scalars(int(step), [(name, float(value)) for name, value in record.items()
                                             if name not in ("step", "time") and isinstance(value, (int, float))
                                             and not isinstance(value, bool)])
        return record

    def discard_after(self, step: int, *, where: Callable[[dict], bool] = lambda record: True) -> int:
        """Drops the JSONL records with `step` > step that match `where` (a resumed run re-logs the
        steps its killed predecessor logged after the last checkpoint); returns how many."""
        if self._jsonl is None:
            return 0
        self._jsonl.flush()
        lines = self.jsonl_path.read_text().splitlines()
        kept = []
        for line in lines:
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line torn by the kill
                    continue
                if record.get("step", 0) > step and where(record):
                    continue
            kept.append(line)
        tmp = self.jsonl_path.with_name(self.jsonl_path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        self._jsonl.close()
        os.replace(tmp, self.jsonl_path)
        self._jsonl = open(self.jsonl_path, "a", buffering=1)
        return len(lines) - len(kept)

    def flush(self) -> None:
        if self._jsonl is not None and not self._jsonl.closed:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: files may already be gone
            pass


def read_metrics(path: str | pathlib.Path) -> list[dict]:
    """All records of a metrics.jsonl (or of `<run_dir>/metrics.jsonl`)."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- progress bar ---------------------------------------------------------------------------------

def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


class ProgressBar:
    """`[stage1] 12/300 [###.......] 4% 3.1s/step ETA 14m53s reward=0.41`.

    On a terminal the line is redrawn in place at every update. Elsewhere (logs, CI) a line is
    printed for the first update, then once at least `log_fraction` of `total` more steps AND
    `log_seconds` more seconds have passed since the last printed line (one line per 5% or per 30 s,
    whichever comes later), and always for the last step (`total`); `close` prints the last update
    if it was not printed, so a log shows where a bar that ended early stopped. The ETA uses the
    mean time per step since the first update, so a slow first step (compilation) stops dominating
    after a few steps.
    """

    def __init__(self, total: int, *, desc: str = "", width: int = 20, stream: TextIO | None = None,
                 start_step: int = 0, clock=time.monotonic, log_fraction: float = 0.05, log_seconds: float = 30.0):
        if total < 1:
            raise ValueError(f"ProgressBar: total must be >= 1, got {total}")
        self.total = total
        self.desc = desc
        self.width = width
        self.stream = stream if stream is not None else sys.stdout
        self.clock = clock
        self.log_fraction = log_fraction
        self.log_seconds = log_seconds
        self._start_step = start_step
        self._start_time = clock()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.last_line = ""  # the last rendered line, printed or not
        self._last: tuple[int, float] | None = None  # step and time of the last update
        self._printed: tuple[int, float] | None = None  # ... of the last printed line (not on a terminal)
        self._pending = False  # the last update's line is not printed yet

    def render(self, step: int, postfix: Mapping[str, Any] | None = None, *, now: float | None = None) -> str:
        elapsed = (self.clock() if now is None else now) - self._start_time
        done = step - self._start_step
        per_step = elapsed / done if done > 0 else float("nan")
        remaining = (self.total - step) * per_step if done > 0 else float("nan")
        fraction = min(max(step / self.total, 0.0), 1.0)
        filled = int(round(fraction * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        parts = [f"[{self.desc}] " if self.desc else "", f"{step}/{self.total} [{bar}] {100 * fraction:.0f}%"]
        if done > 0:
            parts.append(f" {per_step:.2f}s/step ETA {format_duration(remaining)}")
        for key, value in (postfix or {}).items():
            parts.append(f" {key}={value:.4g}" if isinstance(value, float) else f" {key}={value}")
        return "".join(parts)

    def update(self, step: int, **postfix: Any) -> str:
        """Renders `step` and returns the line; prints it on a terminal, or in a log when it is due."""
        now = self.clock()
        line = self.render(step, postfix, now=now)
        if self._tty:
            self.stream.write("\r\x1b[2K" + line)
            self.stream.flush()
            self.last_line, self._last = line, (step, now)
            return line
        due = (self._printed is None or step >= self.total
               or (step - self._printed[0] >= self.log_fraction * self.total
                   and now - self._printed[1] >= self.log_seconds))
        self.last_line, self._last, self._pending = line, (step, now), True
        if due:
            self._print_pending()
        return line

    def _print_pending(self) -> None:
        self.stream.write(self.last_line + "\n")
        self.stream.flush()
        self._printed, self._pending = self._last, False

    def close(self) -> None:
        """Ends the terminal's line; in a log, prints the last update if it was not printed."""
        if self._tty and self.last_line:
            self.stream.write("\n")
            self.stream.flush()
        elif self._pending:
            self._print_pending()


# -- FLOPs and MFU --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FlopCount:
    matmul_params: int  # N: parameters used in matmuls (everything but the input embedding table)
    flops_per_token: float


def qwen3_matmul_params(config: Any) -> int:
    """N for a Qwen3 config: attention and MLP weights of every layer plus the LM head."""
    d, hd = config.hidden_size, config.head_dim
    attention = d * config.num_heads * hd * 2 + d * config.num_kv_heads * hd * 2  # q, o and k, v
    mlp = 3 * d * config.intermediate_size  # gate, up, down
    return config.num_layers * (attention + mlp) + d * config.vocab_size  # + LM head (tied or not)


def flops_per_token(config: Any, seq_len: int, *, training: bool = True) -> FlopCount:
    """FLOPs per token under the module's convention: 6N + 6·L·H·hd·T (training), a third forward."""
    if seq_len < 1:
        raise ValueError(f"flops_per_token: seq_len must be >= 1, got {seq_len}")
    n = qwen3_matmul_params(config)
    attention = 6.0 * config.num_layers * config.num_heads * config.head_dim * seq_len
    total = 6.0 * n + attention
    return FlopCount(matmul_params=n, flops_per_token=total if training else total / 3.0)


def peak_flops_for(device_kind: str) -> float | None:
    """Dense bf16 peak FLOP/s for a `jax.Device.device_kind`, None when unknown (e.g. CPU)."""
    kind = device_kind.lower()
    for needle, key in (("h200", "h200_bf16"), ("h100", "h100_bf16"), ("mi300x", "mi300x_bf16"),
                        ("a100", "a100_bf16")):
        if needle in kind:
            return PEAK_FLOPS[key]
    return None


def throughput(tokens: int, seconds: float, flops_per_token_value: float, *, num_devices: int = 1,
               peak_flops_per_device: float | None = None) -> dict[str, float]:
    """tokens/s, achieved FLOP/s, and MFU (achieved / (devices × peak)) when a peak is given."""
    if seconds <= 0:
        raise ValueError(f"throughput: seconds must be > 0, got {seconds}")
    tokens_per_s = tokens / seconds
    achieved = tokens_per_s * flops_per_token_value
    out = {"tokens_per_s": tokens_per_s, "flops_per_s": achieved}
    if peak_flops_per_device:
        out["mfu"] = achieved / (num_devices * peak_flops_per_device)
    return out
