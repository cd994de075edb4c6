"""Who is in a group and who this process is: the layout every part of a group agrees on."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GroupLayout"]


@dataclass(frozen=True)
class GroupLayout:
    """The group's global ranks (ascending) and this process's global rank."""

    ranks: tuple[int, ...]
    rank: int

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("GroupLayout.ranks: value () is empty")
        if list(self.ranks) != sorted(set(self.ranks)):
            raise ValueError(
                f"GroupLayout.ranks: value {self.ranks!r} must be ascending without duplicates"
            )

    @property
    def root(self) -> int:
        """The group's root: its lowest global rank."""
        return self.ranks[0]

    @property
    def is_member(self) -> bool:
        return self.rank in self.ranks

    @property
    def is_root(self) -> bool:
        return self.rank == self.root

    @property
    def peers(self) -> tuple[int, ...]:
        """Every member except the root."""
        return self.ranks[1:]
