"""Argument checks shared by every public constructor: each error names the argument and the fix.

They raise before anything talks to another rank, so bad input fails alike on every rank: a
message never shows a ``repr`` that holds an address (it differs between processes).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Collection
from typing import Any


def describe(value: object) -> str:
    """``value`` for an error message: its ``repr`` if short and the same in every process,
    else what it is (``the class Net``, ``an object of type Net``)."""
    if isinstance(value, type):
        return f"the class {value.__qualname__}"
    shown = repr(value)
    if len(shown) > 80 or " at 0x" in shown:
        return f"an object of type {type(value).__qualname__}"
    return shown


def shortened(text: str, limit: int) -> str:
    """``text``, cut to ``limit`` characters with ``...`` where it is longer."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_line(exc: BaseException, limit: int = 100) -> str:
    """The first line of ``exc``'s message, cut to ``limit`` characters, for a one-line error
    that quotes it (torch's and DCP's run over many lines)."""
    return shortened((str(exc).strip().splitlines() or [""])[0], limit)


def check_int(name: str, value: object, minimum: int, fix: str = "") -> None:
    """Raise ``ValueError`` unless ``value`` is an integer (not a bool) ``>= minimum``; the
    message ends with ``fix`` if given."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        end = f": {fix}" if fix else ""
        raise ValueError(f"{name} must be an integer >= {minimum}, got {describe(value)}{end}")


def check_number(name: str, value: object, minimum: float, inclusive: bool = True) -> None:
    """Raise ``ValueError`` unless ``value`` is a real number (not a bool) above ``minimum``
    (or equal to it, with ``inclusive``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and (value >= minimum if inclusive else value > minimum):  # type: ignore[operator]
        return
    bound = ">=" if inclusive else ">"
    raise ValueError(f"{name} must be a number {bound} {minimum:g}, got {describe(value)}")


def check_bool(name: str, value: object) -> None:
    """Raise ``TypeError`` unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {describe(value)}")


def check_choice(name: str, value: object, choices: Collection[object]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {allowed}; got {describe(value)}")


def check_instance(name: str, value: object, kind: type, what: str, example: str) -> None:
    """Raise ``TypeError`` unless ``value`` is an instance of ``kind`` (``what``, for the
    message; ``example``: a right value); a subclass of ``kind`` given as it is is told to be
    instantiated."""
    if isinstance(value, kind):
        return
    if isinstance(value, type) and issubclass(value, kind):
        raise TypeError(
            f"{name}={value.__name__} is a class: pass an instance, {name}={value.__name__}(...)"
        )
    raise TypeError(f"{name} must be {what}, got {describe(value)}: e.g. {name}={example}")


def check_list(name: str, value: object, kind: type, what: str, one: str) -> list[Any]:
    """``value`` (a list or tuple of ``kind`` instances, ``what`` for the message; ``None``:
    empty) as a list; a single instance passed bare is told to go in a list (``one``: how the
    message calls it)."""
    if value is None:
        return []
    if isinstance(value, kind):
        raise TypeError(
            f"{name} must be a list of {what}, got a single {type(value).__name__}: pass a "
            f"list, {name}=[{one}]"
        )
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of {what}, got {describe(value)}")
    for i, item in enumerate(value):
        if isinstance(item, type) and issubclass(item, kind):
            cls = item.__name__
            raise TypeError(f"{name}[{i}] is the class {cls}: pass an instance, {cls}(...)")
        if not isinstance(item, kind):
            raise TypeError(f"{name} must hold {what}; {name}[{i}] is {describe(item)}")
    return list(value)


def check_path(name: str, value: object) -> str | None:
    """``value`` (a directory path: ``str``, ``os.PathLike`` or ``None``) as a ``str``."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"{name} must be a directory path (str or pathlib.Path) or None, got {describe(value)}"
        )
    path = os.fspath(value)
    if not isinstance(path, str) or not path:
        raise ValueError(f"{name} must be a non-empty directory path, got {describe(value)}")
    return path


def check_file_path(name: str, value: object) -> str | None:
    """``value`` (the path of a file to write: ``str``, ``os.PathLike`` or ``None``) as a
    ``str``; an existing directory is refused."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not isinstance(os.fspath(value), str):
        raise TypeError(
            f"{name} must be a file path (str or pathlib.Path) or None, got {describe(value)}"
        )
    path = os.fspath(value)
    if not path or os.path.isdir(path):
        raise ValueError(
            f"{name}={path!r} is a directory: pass the path of a file to write, e.g. "
            f"{name}={os.path.join(path or '.', 'log.jsonl')!r}"
        )
    return path


def check_optional_str(name: str, value: object, example: str) -> str | None:
    """``value`` (a non-empty ``str`` or ``None``); ``example``: a right value."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, got {describe(value)}: e.g. {example}")
    if value == "":
        raise ValueError(f"{name} must not be empty: pass a name, e.g. {example}, or None")
    return value


def check_writable_dir(name: str, path: str) -> None:
    """Raise ``ValueError`` naming ``name``, the path and the fix unless this process can write
    in the directory ``path``, or create it: its nearest existing ancestor must be a directory
    that takes a probe file (written and removed at once, so that a read-only file system or
    directory is caught even for root). Nothing is created."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(
            f"{name}={path!r} is not a directory ({existing!r} is a file): pass a directory path"
        )
    probe = os.path.join(existing, f".fastdist-probe-{uuid.uuid4().hex}")
    try:
        with open(probe, "x"):
            pass
        os.remove(probe)
    except OSError as exc:
        where = "" if existing == os.path.abspath(path) else f" cannot be created: {existing!r}"
        raise ValueError(
            f"{name}={path!r}{where} is not writable by this process ({exc.strerror or exc}): "
            "pass a directory it can create and write to, or fix the permissions"
        ) from exc
