"""What the fault campaigns print: one table (text columns left, counts right), and every run as JSON when asked.

Shared by ``campaign.py`` and ``bit_campaign.py``, which import it and never each other.
"""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

TEXT_COLUMNS = {"configuration", "class", "site", "bits", "by check"}


def report(title: str, columns: list[str], rows: list[list[str]], json_out: str | None, payload: dict) -> None:
    """Print a campaign's table and keep every run as JSON in ``json_out`` when given."""
    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="left" if c in TEXT_COLUMNS else "right")
    for row in rows:
        t.add_row(*row)
    Console(width=200).print(t)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(payload, f, indent=1)
