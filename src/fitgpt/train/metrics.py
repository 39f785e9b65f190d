"""Where training numbers go: metrics.jsonl always, TensorBoard when installed, a loss-curve PNG at the end."""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def _step(line: str) -> int | None:
    """The step of a metrics line; None for a line cut off by a crash."""
    try:
        return int(json.loads(line).get("step", 0))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return None


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool, resume_step: int = 0) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        if self.path.exists():
            # On resume, drop lines past the checkpoint so the file describes one consistent run.
            kept = [line for line in self.path.read_text().splitlines() if _step(line) is not None and _step(line) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:
                log.debug("tensorboard not installed; metrics go to metrics.jsonl only")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def plot_loss_curve(metrics_path: Path, out_png: Path) -> Path | None:
    """Train and val loss against step, from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
