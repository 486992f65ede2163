"""Whole models out of fastdist: one file, or a Hugging Face folder, written atomically; and
the model of a checkpoint read offline, with no process group.

Formats (``FORMATS``):

* ``"torch"``: ``torch.save`` of the ``state_dict`` (``torch.load(weights_only=True)`` reads it).
* ``"safetensors"``: one ``.safetensors`` file of the ``state_dict`` (``pip install
  safetensors``); every name is kept, a tied weight's too, so that it loads strictly.
* ``"hf"``: the folder the model's own ``save_pretrained`` writes (``config.json``,
  ``model.safetensors``...), which ``from_pretrained`` loads.

A file is written to a temp file and renamed; a new folder is written under a temp name and
renamed, and in a folder that exists already (say one holding a tokenizer) each file is
replaced by a rename and the other files stay.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import uuid
import warnings
from typing import Any

import torch
from torch import nn

from fastdist.checkpoint.files import (
    MANIFEST,
    CheckpointDir,
    atomic_file,
    atomic_save,
    expected_checksums,
    fsync_dir,
    load_checkpoint,
    new_file_mode,
)
from fastdist.checkpoint.format1 import upgrade
from fastdist.checkpoint.resume import Candidate, listed, unverified
from fastdist.checkpoint.sharded import checked_metadata
from fastdist.checks import check_choice, check_writable_dir, describe, first_line
from fastdist.logging import logger

FORMATS = ("torch", "safetensors", "hf")
#: The name a best-model file of each format ends with (a Hugging Face one is a folder).
SUFFIXES = {"torch": ".pt", "safetensors": ".safetensors", "hf": ""}


def check_format(name: str, format: Any, model: nn.Module | None) -> None:
    """Raise (alike on every rank) unless ``format`` is one of :data:`FORMATS` that can be
    written here: ``"safetensors"`` needs the package, ``"hf"`` a model with
    ``save_pretrained`` (a transformers ``PreTrainedModel``)."""
    check_choice(name, format, FORMATS)
    if format == "safetensors":
        _safetensors(name)
    if format == "hf" and not callable(getattr(model, "save_pretrained", None)):
        raise ValueError(
            f"{name}='hf' writes the folder of the model's save_pretrained (a transformers "
            f"PreTrainedModel), which {type(model).__name__} lacks: use {name}='safetensors' "
            "or 'torch' (one file of its state_dict)"
        )


def check_path(path: Any) -> str:
    """``save_model``'s ``path`` (a ``str`` or ``os.PathLike``) as a ``str``."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(
            f"path must be a file or folder path (str or pathlib.Path), got {describe(path)}"
        )
    return str(os.fspath(path))


def check_target(name: str, path: str, format: str) -> None:
    """Raise unless ``path`` (the argument ``name``) can take ``format``'s file or folder
    (probed: nothing is created) without touching a checkpoint directory."""
    refuse_in_checkpoints(name, path, folder=format == "hf")
    if format == "hf":
        if os.path.isfile(path):
            raise ValueError(
                f"{name}={path!r} is a file, and format='hf' writes a folder (config.json, "
                "model.safetensors): pass a folder path"
            )
        check_writable_dir(name, path)
        return
    if os.path.isdir(path):
        example = os.path.join(path, "model" + SUFFIXES[format])
        raise ValueError(
            f"{name}={path!r} is a folder, and format={format!r} writes one file: pass a file "
            f"path, e.g. {example!r}"
        )
    check_writable_dir(name, os.path.dirname(os.path.abspath(path)))


def write_model(
    weights: dict[str, Any], path: str, format: str, model: nn.Module | None = None
) -> None:
    """Write a whole model's ``weights`` (a full ``state_dict`` on the CPU) to ``path`` in
    ``format``, atomically (``model``: the model whose ``save_pretrained`` writes ``"hf"``)."""
    if format == "torch":
        atomic_save(weights, path)
    elif format == "safetensors":
        tensors = _unshared(weights)
        with atomic_file(path) as f:  # save_file would replace it by a file of mode 0o600
            f.write(_safetensors("format").save(tensors, metadata={"format": "pt"}))
    else:
        assert model is not None
        _write_folder(model, weights, path)


def read_model(path: str, cls: type[nn.Module]) -> dict[str, Any]:
    """The ``state_dict`` :func:`write_model` wrote to ``path`` (a folder is loaded as
    ``cls.from_pretrained`` loads it: tied weights and renamed keys as the model has them)."""
    if os.path.isdir(path):
        return cls.from_pretrained(path).state_dict()  # type: ignore[attr-defined]
    if path.endswith(SUFFIXES["safetensors"]):
        return dict(_safetensors("format").load_file(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def export_checkpoint(checkpoint: str, out: str, format: str, overwrite: bool = False) -> str:
    """Write the model of ``checkpoint`` (see :func:`checkpoint_weights`) to the file ``out``
    in ``format`` (``"torch"`` or ``"safetensors"``); return the checkpoint it came from.
    ``out`` may not lie in any checkpoint directory (links resolved): it would replace a
    checkpoint's file or a manifest; nor replace a file unless ``overwrite``."""
    check_choice("format", format, FORMATS[:2])
    if format == "safetensors":
        _safetensors("format")
    _check_out(out, checkpoint, overwrite)
    check_target("OUT", out, format)
    weights, source = checkpoint_weights(checkpoint)
    write_model(weights, out, format)
    return source


def checkpoint_weights(path: str) -> tuple[dict[str, Any], str]:
    """The whole model's ``state_dict`` in the checkpoint at ``path``, read offline (no
    process group), and the checkpoint's path; its checksums verified as a resume verifies
    them.

    ``path`` is a checkpoint file (``step-*.pt``, of any format fastdist wrote), a sharded
    checkpoint's directory (DCP shards: only the model's are read, not the optimizer's), a
    checkpoint directory (the newest checkpoint its ``manifest.json`` lists that verifies) or
    a plain ``state_dict`` file (a best model).
    """
    path = _verified(path)
    saved = _load(path)  # weights_only; a sharded one's trainer.pt
    neither = f"{path} is not a checkpoint fastdist wrote, nor a state_dict (names to tensors)"
    if not isinstance(saved, dict):
        raise ValueError(f"{neither}: it holds a {type(saved).__name__}")
    if "parts" not in saved and saved.get("format") != 1:
        if saved and all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in saved.items()
        ):
            return saved, path  # a state_dict already
        raise ValueError(neither if saved else f"{neither}: it is an empty dict")
    checkpoint = upgrade(saved)
    if "model" in checkpoint["sharded"]:
        return _sharded_model(path), path
    if "model" in checkpoint["parts"]:
        return checkpoint["parts"]["model"], path
    if "model" in checkpoint["per_rank"]:  # local SGD: each rank's parameters
        logger.warning("%s holds every rank's own model (local SGD): exporting rank 0's", path)
        return checkpoint["per_rank"]["model"][0], path
    raise ValueError(f"{path} holds no model")


def _is_checkpoint_dir(path: str) -> bool:
    """Whether ``path`` is a directory of checkpoints (not a sharded checkpoint itself)."""
    return os.path.isdir(path) and not os.path.exists(os.path.join(path, ".metadata"))


def _holds_checkpoints(directory: str) -> bool:
    """Whether ``directory`` is fastdist's: a sharded checkpoint, or a checkpoint directory
    (a ``manifest.json`` of ours, a rollback's set-aside one included, or ``step-*`` ones)."""
    if os.path.exists(os.path.join(directory, ".metadata")):
        return True
    try:
        held = CheckpointDir(directory, keep=1).held()
    except (OSError, ValueError):  # unreadable, or someone else's manifest.json
        return False
    return bool(held) or os.path.isfile(os.path.join(directory, MANIFEST))


def refuse_in_checkpoints(name: str, out: str, folder: bool = False) -> None:
    """Refuse an ``out`` (the argument ``name``) that lies in any fastdist checkpoint directory,
    links resolved, where it would replace a checkpoint's file or the manifest (with
    ``folder``: or that is such a directory, which writing a folder there would replace)."""
    target = os.path.realpath(out)
    directory = target if folder else os.path.dirname(target)
    while True:
        if _holds_checkpoints(directory):
            raise ValueError(
                f"{name}={out!r} lies in the checkpoint directory {directory!r} (links "
                "resolved), where it would replace a checkpoint's file or the manifest: pass "
                "a path outside it"
            )
        parent = os.path.dirname(directory)
        if parent == directory:
            return
        directory = parent


def _check_out(out: str, checkpoint: str, overwrite: bool) -> None:
    """Refuse an ``out`` that is ``checkpoint``, lies in any fastdist checkpoint directory
    (links resolved: it would replace a checkpoint's file or a manifest), or is a file that
    exists already, unless ``overwrite``."""
    if os.path.realpath(out) == os.path.realpath(checkpoint):
        raise ValueError(f"the output {out!r} is the checkpoint itself: pass another path")
    refuse_in_checkpoints("OUT", out)
    if os.path.lexists(out) and not overwrite:
        raise FileExistsError(
            f"OUT={out!r} exists already: pass another path, or --overwrite to replace it"
        )


def _verified(path: str) -> str:
    """The checkpoint ``path`` names, its files checked against the manifest's CRC-32 (those
    of a file no manifest lists: none); of a checkpoint directory, the newest that verifies."""
    if not _is_checkpoint_dir(path):
        problem = unverified(listed(path))
        if problem is not None:
            raise ValueError(f"{path} cannot be exported: {problem}; pass another checkpoint")
        return path
    entries = CheckpointDir(path, keep=1).entries()
    if not entries:
        raise ValueError(
            f"{path} is neither a checkpoint nor a checkpoint directory whose "
            "manifest.json lists some: pass a step-* file or directory"
        )
    for entry in reversed(entries):
        candidate = Candidate(os.path.join(path, entry["file"]), expected_checksums(path, entry))
        problem = unverified(candidate)
        if problem is None:
            return candidate.path
        logger.warning("skipping checkpoint %s: %s", candidate.path, problem)
    raise ValueError(f"{path}: no checkpoint its manifest.json lists verifies (see above)")


def _load(path: str) -> dict[str, Any]:
    """:func:`load_checkpoint`, with what torch cannot read as a one-line error naming it."""
    try:
        return load_checkpoint(path)
    except Exception as exc:  # a text file, a truncated one: torch's words vary and advise
        if isinstance(exc, (OSError, ValueError)) and path in str(exc):
            raise  # a missing file, an incomplete sharded one: named already
        # weights_only=False for what it cannot unpickle, which fastdist never needs
        detail = f"{type(exc).__name__}: {first_line(exc)}"
        if isinstance(exc, pickle.UnpicklingError):
            detail = "no torch.save file of tensors and plain data"
        raise ValueError(
            f"{path} is not a checkpoint: torch.load cannot read it ({detail}); pass a step-* "
            "file or directory fastdist wrote, or a checkpoint directory"
        ) from exc


def _sharded_model(path: str) -> dict[str, torch.Tensor]:
    """The model part of the DCP checkpoint ``path``, whole, read in one process: tensors
    shaped as its metadata says, filled in place by ``dcp.load`` (which reassembles the
    shards of any number of ranks). The optimizer's shards are not read."""
    import torch.distributed.checkpoint as dcp  # ~0.7 s with DTensor: sharded checkpoints only
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = checked_metadata(path, "export an earlier checkpoint of its directory")
    model = {}
    for key, meta in metadata.state_dict_metadata.items():
        part, *name = metadata.planner_data[key]  # the nested path: ("model", "fc.weight")
        if part != "model":
            continue
        if not isinstance(meta, TensorStorageMetadata) or len(name) != 1:
            raise ValueError(f"{path}: the model's {key!r} is not a tensor of a state_dict")
        model[name[0]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # that no process group is there is the point
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": model}, checkpoint_id=path, no_dist=True)
    return model


def _safetensors(name: str) -> Any:
    """``safetensors.torch``, or an error saying how to install it."""
    try:
        import safetensors.torch
    except ImportError as exc:
        raise ImportError(
            f"{name}='safetensors' needs the safetensors package: pip install "
            "'fastdist[safetensors]' (or pip install safetensors)"
        ) from exc
    return safetensors.torch


def _unshared(weights: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``weights`` as safetensors stores them: contiguous tensors sharing no memory (a tied
    weight gets a copy under each of its names, so that the file loads strictly)."""
    seen: set[int] = set()
    tensors = {}
    for name, value in weights.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"safetensors stores tensors only; the state_dict's {name!r} is "
                f"{describe(value)}: use format='torch'"
            )
        tensor = value.detach().contiguous()
        if tensor.untyped_storage().data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    return tensors


def _write_folder(model: nn.Module, weights: dict[str, Any], path: str) -> None:
    """``model.save_pretrained`` of ``weights`` into a temp folder, fsynced, then renamed to
    ``path``, or, where ``path`` exists, its files renamed into it one by one."""
    parent, name = os.path.split(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{uuid.uuid4().hex}-{name}")
    try:
        # With the full weights given it reads none from the (maybe sharded) model.
        model.save_pretrained(tmp, state_dict=weights)  # type: ignore[operator]
        mode = new_file_mode(tmp)  # safetensors makes its files 0o600
        for file in os.listdir(tmp):
            os.chmod(os.path.join(tmp, file), mode)
            with open(os.path.join(tmp, file), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        if not os.path.exists(path):
            os.replace(tmp, path)
        else:
            for file in os.listdir(tmp):
                os.replace(os.path.join(tmp, file), os.path.join(path, file))
            fsync_dir(path)
        fsync_dir(parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)
