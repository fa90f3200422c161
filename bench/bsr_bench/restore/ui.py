"""Progress bars and a results table that grows while the bench runs (rich)."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from .report import results_table


class BenchUI:
    """A live view: one progress bar for the whole run, one for the current step, the table."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
        )
        self.points: list[dict[str, Any]] = []
        self._overall: Any = None
        self._step: Any = None
        self._live = Live(self._render(), console=self.console, refresh_per_second=4)

    def _render(self) -> Group:
        if self.points:
            return Group(self.progress, results_table(self.points, "results so far (medians)"))
        return Group(self.progress)

    def __enter__(self) -> BenchUI:
        self._live.__enter__()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.progress.stop()
        self._live.update(Group(self.progress))
        self._live.__exit__(et, ev, tb)

    def start(self, total: int) -> None:
        self._overall = self.progress.add_task("[bold]bench", total=total)

    def step(self, description: str, total: int) -> None:
        if self._step is not None:
            self.progress.remove_task(self._step)
        self._step = self.progress.add_task(description, total=total)

    def advance(self, n: int = 1) -> None:
        if self._step is not None:
            self.progress.advance(self._step, n)
        if self._overall is not None:
            self.progress.advance(self._overall, n)

    def add_point(self, point: dict[str, Any]) -> None:
        self.points.append(point)
        self._live.update(self._render())

    def log(self, message: str) -> None:
        self.console.log(message)
