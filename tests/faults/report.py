"""What the suite tried and what happened: one row per kind of fault, printed as a table."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Row:
    """One kind of fault. An attempt is one fault actually delivered (a kill that landed, a corruption,
    a bad input); it survived when every check after it held. Samples lost: samples of the uninterrupted
    result missing from the result after the fault without an error naming them; duplicated: samples
    present (or trained on) more than once."""

    fault: str
    min_attempts: int = 1  # fewer attempts than this (kills that all landed too late) is a failure too
    attempts: int = 0
    survived: int = 0
    lost: int = 0
    duplicated: int = 0
    wall_s: float = 0.0
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def record(self, what: str, problems: list[str], lost: int = 0, duplicated: int = 0) -> bool:
        """Count one attempt; `problems` empty means it survived."""
        self.attempts += 1
        self.lost += lost
        self.duplicated += duplicated
        if problems or lost or duplicated:
            extra = [f"{lost} sample(s) lost"] * bool(lost) + [f"{duplicated} sample(s) duplicated"] * bool(duplicated)
            self.failures.append(f"{what}: " + "; ".join(problems + extra))
            return False
        self.survived += 1
        return True

    @property
    def ok(self) -> bool:
        return (self.attempts >= self.min_attempts and self.survived == self.attempts and not self.lost
                and not self.duplicated)


# The key under which a pytest test puts its rows (as dicts) in its report; tests/conftest.py prints them as one table.
FAULT_ROWS = "fault rows"

HEADER = ("fault", "attempts", "survived", "samples lost", "samples duplicated", "wall s")


def render(rows: list[Row], verbose: bool = False) -> str:
    """The table (and, with `verbose` or on failure, what went wrong and what was skipped)."""
    cells = [HEADER] + [(r.fault, str(r.attempts), str(r.survived), str(r.lost), str(r.duplicated), f"{r.wall_s:.0f}")
                        for r in rows]
    total = ("total", str(sum(r.attempts for r in rows)), str(sum(r.survived for r in rows)),
             str(sum(r.lost for r in rows)), str(sum(r.duplicated for r in rows)), f"{sum(r.wall_s for r in rows):.0f}")
    cells.append(total)
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]

    def fmt(c):
        return "  ".join(c[0].ljust(widths[0]) if i == 0 else c[i].rjust(widths[i]) for i in range(len(c)))

    rule = "  ".join("-" * w for w in widths)
    lines = [fmt(cells[0]), rule] + [fmt(c) for c in cells[1:-1]] + [rule, fmt(cells[-1])]
    for r in rows:
        if r.attempts < r.min_attempts:
            lines.append(f"FAILED [{r.fault}] only {r.attempts} attempt(s) landed, expected at least {r.min_attempts}")
        for f in r.failures:
            lines.append(f"FAILED [{r.fault}] {f}")
        if verbose:
            lines += [f"  note [{r.fault}] {n}" for n in r.notes]
    return "\n".join(lines)
