"""One output helper for every command.

Human mode prints rich tables on stdout; ``--json`` prints exactly one JSON
document on stdout and nothing else. Logs, progress and errors go to stderr,
so ``vckpt ... --json | jq`` always works.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from verified_ckpt import HEALTH_COLOURS, PALETTE

# rich is imported where output is made: ``vckpt --help`` and argument errors never need it.
if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

STATUS_STYLE = {status: c.terminal for status, c in PALETTE.items()} | {s: c.terminal for s, c in HEALTH_COLOURS.items()}


class Output:
    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.out = _console(stderr=False)
        if not self.out.is_terminal:
            self.out.width = max(self.out.width, 120)  # piped output: no terminal to fit, keep rows whole
        self.err = _console(stderr=True)

    def emit(self, data: Any, human: Callable[[Console], None]) -> None:
        """Print ``data`` as JSON in ``--json`` mode, else call ``human`` with the stdout console."""
        if self.as_json:
            sys.stdout.write(json.dumps(data, sort_keys=True) + "\n")
            sys.stdout.flush()
        else:
            human(self.out)

    def table(self, title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
        from rich import box
        from rich.table import Table

        t = Table(title=title, box=box.SIMPLE_HEAD, header_style="bold", title_justify="left")
        for i, c in enumerate(columns):
            # Ids are what users copy into the next command: never shorten them.
            t.add_column(c, no_wrap=c in ("id", "status", "step", "size"), overflow="fold",
                         min_width=max((len(str(r[i])) for r in rows), default=0) if c == "id" else None)

        for r in rows:  # cells hold what the store said: shown, never acted on by the terminal (a newline included)
            t.add_row(*[status_text(v) if c == "status" else printable(str(v), keep="")
                        for c, v in zip(columns, r, strict=True)])
        return t

    def log(self, message: str) -> None:
        self.err.print(message)

    @contextmanager
    def progress(self, total: int, label: str) -> Iterator[Callable[[int], None]]:
        """A byte progress bar on a terminal's stderr; a no-op elsewhere."""
        if not self.err.is_terminal or total <= 0:
            yield lambda n: None
            return
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

        bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                       TimeRemainingColumn(), console=self.err, transient=True)
        with bar:
            task = bar.add_task(label, total=total)
            yield lambda n: bar.advance(task, n)


def escape(text: str) -> str:
    """``text`` shown verbatim in rich markup (messages quote lists such as ``[0, 1]`` that rich would parse), and on
    one line: what a record or a store holds can end no line and start no fake one (``printable``)."""
    from rich.markup import escape as rich_escape

    return rich_escape(printable(text, keep=""))


def printable(text: str, keep: str = "\n") -> str:
    """``text`` with every character a terminal would act on (an escape sequence, a carriage return, a bell, and
    a newline unless ``keep`` has it) written out as Python writes it (``\\x1b``): text from a record, a manifest
    or a user's file is shown as it is, never run by the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


def _console(stderr: bool) -> Console:
    """rich's console, with every string it is given made printable first: no command's output, whatever it
    quotes, can move the cursor, clear the screen or restyle the terminal (rich's own styles are added later)."""
    from rich.console import Console

    class Safe(Console):
        def print(self, *objects: Any, **kwargs: Any) -> None:
            super().print(*(printable(o) if isinstance(o, str) else o for o in objects), **kwargs)

    return Safe(stderr=stderr, highlight=False, soft_wrap=True)


def status_text(value: Any) -> str:
    style = STATUS_STYLE.get(str(value))
    return f"[{style}]{value}[/]" if style else str(value)


def human_size(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"
