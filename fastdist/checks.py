"""Argument checks shared by every public constructor: each error names the argument and the fix.

They raise before anything talks to another rank, so bad input fails alike on every rank.
"""

from __future__ import annotations

from collections.abc import Collection


def check_int(name: str, value: object, minimum: int) -> None:
    """Raise ``ValueError`` unless ``value`` is an integer (not a bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_number(name: str, value: object, minimum: float, inclusive: bool = True) -> None:
    """Raise ``ValueError`` unless ``value`` is a real number (not a bool) above ``minimum``
    (or equal to it, with ``inclusive``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and (value >= minimum if inclusive else value > minimum):  # type: ignore[operator]
        return
    bound = ">=" if inclusive else ">"
    raise ValueError(f"{name} must be a number {bound} {minimum:g}, got {value!r}")


def check_bool(name: str, value: object) -> None:
    """Raise ``TypeError`` unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_choice(name: str, value: object, choices: Collection[object]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {allowed}; got {value!r}")
