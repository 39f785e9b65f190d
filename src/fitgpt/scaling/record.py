"""A ladder's own record in its --work-dir (ladder.json): the recipe it trains, and each depth it finished with its
points, written as each depth ends. A ladder stopped part way (Ctrl-C, a signal, a crash) is continued by the same
command: the depths it finished are taken as they were, the time they took counted against the budget; a depth it had
begun is trained again."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from fitgpt.config import TrainConfig, to_dict
from fitgpt.errors import UserError

log = logging.getLogger(__name__)

RECORD = "ladder.json"


@dataclass
class Rung:
    """One depth of the ladder as it trained: its parameters (non-embedding, and those a token's compute passes
    through), the tokens/s its run had, its steps."""

    depth: int
    n_params: int
    compute_params: int
    tokens_per_s: float
    steps: int


@dataclass
class LadderRecord:
    path: Path
    key: dict
    """What makes two tries the same ladder: the recipe, the depths and the budget."""
    spent: float = 0.0
    """Seconds the earlier tries took."""
    done: dict = field(default_factory=dict)
    """depth -> (Rung, its points), for each depth finished."""
    design: list[int] | None = None
    """The depths the first try's design chose (`fitgpt.scaling.design`): a try that continues trains the same."""

    @classmethod
    def open(cls, work: Path, recipe: TrainConfig, depths: tuple[int, ...], budget: float, overwrite: bool,
             family: dict | None = None) -> LadderRecord:
        """The record of ``work``: new where it is empty (or --overwrite), continued where it holds the same ladder
        stopped part way; otherwise refused in one line (nothing is changed)."""
        key = {"recipe": to_dict(recipe), "depths": sorted(depths), "budget_seconds": budget, "family": family or {}}
        path = work / RECORD
        if overwrite and work.exists():  # the ladder's own runs and record, nothing else of the folder's
            for own in [path, *work.glob("depth*")]:
                shutil.rmtree(own) if own.is_dir() else own.unlink()
        if work.exists() and any(work.iterdir()):
            saved = _read(path)
            if saved is None or saved.get("key") != json.loads(json.dumps(key)) or saved.get("finished"):
                raise UserError(f"--work-dir {work} holds an earlier ladder's runs: add --overwrite to replace them, or "
                                "name another --work-dir (the same command continues a ladder that was stopped)")
            done = {int(d): (Rung(**r["rung"]), r["points"]) for d, r in saved["done"].items()}
            log.info("continuing the ladder in %s: %d of %d depths done, %.0fs spent", work, len(done), len(depths),
                     saved["spent"])
            design = saved.get("design")
            return cls(path, key, float(saved["spent"]), done, [int(d) for d in design] if design else None)
        return cls(path, key)  # written once a depth ends or the ladder stops: a refusal before any run leaves nothing

    def add(self, rung, points: list[dict], spent_now: float) -> None:
        """Depth ``rung.depth`` finished with ``points``, ``spent_now`` seconds into the ladder (earlier tries too)."""
        self.done[rung.depth] = (rung, points)
        self.spent = spent_now
        self._write()

    def spend(self, spent_now: float) -> None:
        """The ladder stopped ``spent_now`` seconds in (earlier tries too): its next try has what is left."""
        self.spent = spent_now
        self._write()

    def finish(self, spent_now: float) -> None:
        self.spent = spent_now
        self._write(finished=True)

    def _write(self, finished: bool = False) -> None:
        body = {"key": self.key, "spent": self.spent, "finished": finished, "design": self.design,
                "done": {str(d): {"rung": dataclasses.asdict(r), "points": p} for d, (r, p) in self.done.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, self.path)  # whole or not at all, whenever the ladder stops


def _read(path: Path) -> dict | None:
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) and isinstance(saved.get("done"), dict) else None
