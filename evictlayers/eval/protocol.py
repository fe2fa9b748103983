"""The tuning / held-out protocol (``evictlayers eval --split tuning|held_out``): a recipe parameter chosen
by measurement is chosen on the tuning split and reported on the held-out split, which it never saw.

The two splits of RULER's synthetic tasks (:mod:`evictlayers.eval.tasks.ruler`) differ in three ways:

- **Books**: the PG-19 sample books (sorted by file name) alternate between the splits, the first to
  tuning, the second to held-out, and so on; essay haystacks, word keys and the word lists of ``cwe``
  come only from the split's own books (:func:`split_books`).
- **Seeds**: each split draws its prompts from its own seed (:data:`SPLITS`), so no prompt, key or needle
  position is shared even within a family both splits contain.
- **Haystack families** (:data:`FAMILIES`): the tuning split holds the ``essay`` and ``needle`` families;
  the held-out split holds those (other books, other seeds) and two families the tuning split never
  sees: ``noise`` (RULER's repeated sentences: ``niah_single_1``, and ``vt``'s chains, which hide in
  the same noise) and ``words`` (the word-list aggregation tasks ``cwe`` and ``fwe``).

A recipe tuned on prose and needle lists is then reported on prose from other books and on filler and
word lists it never met, so a choice that only fits the prompts it was tuned on shows as a held-out loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from evictlayers.eval.tasks.ruler.spec import TASKS

__all__ = ["FAMILIES", "SPLITS", "Split", "family_of", "split_books", "split_seed", "split_tasks"]

# RULER's tasks by what their context is made of
FAMILIES: dict[str, tuple[str, ...]] = {
    "essay": ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery"),
    "needle": ("niah_multikey_2", "niah_multikey_3"),
    "noise": ("niah_single_1", "vt"),
    "words": ("cwe", "fwe"),
}


@dataclasses.dataclass(frozen=True)
class Split:
    """One side of the protocol: its name, its prompt seed, which half of the sorted books it reads
    (``book_parity``: index modulo 2) and the haystack families it holds."""

    name: str
    seed: int
    book_parity: int
    families: tuple[str, ...]

    @property
    def tasks(self) -> tuple[str, ...]:
        """Its RULER tasks, in RULER's order."""
        return tuple(t for t in TASKS if family_of(t) in self.families)


SPLITS: dict[str, Split] = {
    s.name: s
    for s in (
        Split("tuning", seed=1, book_parity=0, families=("essay", "needle")),
        Split("held_out", seed=2, book_parity=1, families=("essay", "needle", "noise", "words")),
    )
}


def family_of(task: str) -> str:
    """The haystack family of RULER task ``task``."""
    for family, names in FAMILIES.items():
        if task in names:
            return family
    raise ValueError(f"unknown RULER task {task!r}; the tasks: {', '.join(TASKS)}")


def _split(name: str) -> Split:
    if name not in SPLITS:
        raise ValueError(f"unknown split {name!r} (--split); allowed: {', '.join(SPLITS)}")
    return SPLITS[name]


def split_books(texts: Sequence[tuple[str, str]], split: str) -> list[tuple[str, str]]:
    """The books of ``split`` among ``texts`` (``[(file name, text)]``): sorted by name, every other one.

    Raises:
        ValueError: an unknown split, or fewer than two books (the splits could not have their own).
    """
    chosen = _split(split)
    if len(texts) < 2:
        raise ValueError(f"the tuning and held-out splits need at least two books (one each); got {len(texts)}")
    ordered = sorted(texts, key=lambda item: item[0])
    return [item for i, item in enumerate(ordered) if i % 2 == chosen.book_parity]


def split_seed(split: str, seed: int | None) -> int:
    """The seed ``split`` draws its prompts from.

    Raises:
        ValueError: an unknown split, or a ``seed`` given beside it (the split fixes its own).
    """
    chosen = _split(split)
    if seed is not None:
        raise ValueError(f"--seed {seed} with --split {split}: a split draws from its own seed "
                         f"({', '.join(f'{s.name} {s.seed}' for s in SPLITS.values())}); drop one")
    return chosen.seed


def split_tasks(split: str, tasks: Sequence[str] | None = None) -> list[str]:
    """``tasks`` (default: all of the split's), checked to belong to ``split``.

    Raises:
        ValueError: an unknown split, or a task of a family the split does not hold (the tuning split
            must never see a held-out family).
    """
    chosen = _split(split)
    if tasks is None:
        return list(chosen.tasks)
    outside = [t for t in tasks if family_of(t) not in chosen.families]
    if outside:
        families = sorted({family_of(t) for t in outside})
        raise ValueError(
            f"RULER task(s) {outside} (--ruler-tasks) are in the {', '.join(families)} family, which the {split} "
            f"split does not hold; its tasks: {', '.join(chosen.tasks)}"
        )
    return list(tasks)
