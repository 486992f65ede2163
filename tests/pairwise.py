"""A pairwise covering of option values: every pair of values of two options in some case.

A small greedy construction (as in AETG): each new case starts from an uncovered pair and
fills every other option with the value that covers the most pairs still uncovered, among the
values allowed with what is chosen so far. Deterministic: ties go to the first value.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Case = dict[str, Any]


def pairwise(options: Mapping[str, Sequence[Any]], allowed: Callable[[Case], bool]) -> list[Case]:
    """Cases (``{option: value}``) covering every allowed pair of values of two options.

    ``allowed(partial_case)`` says whether a (partial) assignment may occur in a run; a pair it
    refuses on its own is not required (the caller checks that fastdist refuses it).
    """
    names = list(options)
    uncovered = {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(names, 2)
        for va in options[a]
        for vb in options[b]
        if allowed({a: va, b: vb})
    }
    cases: list[Case] = []
    while uncovered:
        (a, va), (b, vb) = min(uncovered, key=lambda pair: (names.index(pair[0][0]), str(pair)))
        case: Case = {a: va, b: vb}
        for name in names:
            if name in case:
                continue
            fits = [v for v in options[name] if allowed({**case, name: v})]
            if not fits:
                raise ValueError(f"no value of {name!r} is allowed with {case}")
            case[name] = max(fits, key=lambda v: _gain(case, name, v, uncovered))
        uncovered -= {p for p in itertools.combinations(sorted(case.items()), 2)} | {
            (x, y) for x, y in itertools.permutations(case.items(), 2)
        }
        cases.append(case)
    return cases


def _gain(case: Case, name: str, value: Any, uncovered: set) -> int:
    """How many uncovered pairs choosing ``name=value`` would cover, with ``case``."""
    return sum(
        ((name, value), other) in uncovered or (other, (name, value)) in uncovered
        for other in case.items()
    )
