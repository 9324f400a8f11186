"""Model names: the one check every path that takes a name goes through.

A model name is ``[A-Za-z0-9_.-]{1,128}`` (so never ``#``, which the partitions' hash
tags of batching/keys.py rely on), never ``.`` or ``..`` and with no ``..`` in it, and it
names a folder that lies inside the model repository once every symlink is resolved.
Whatever fails (a bad name, a folder outside the repository, no folder at all) gets the
same answer, :func:`unknown_model`, whose text holds no path: a client learns nothing
about the server's file system from it.
"""

from __future__ import annotations

import re
from pathlib import Path

from batching.errors import InvalidInput, ModelNotFound

MAX_NAME_LENGTH = 128
_NAME = re.compile(rf"[A-Za-z0-9_.-]{{1,{MAX_NAME_LENGTH}}}")


def valid_name(name: str) -> bool:
    """Whether ``name`` may name a model (its folder is not checked)."""
    return _NAME.fullmatch(name) is not None and ".." not in name and name != "."


def unknown_model(name: str) -> ModelNotFound:
    """The one answer for a name that is invalid, outside the repository or absent,
    worded as Triton words it (its clients and tests match the text)."""
    return ModelNotFound(f"Request for unknown model: {_shown(name)!r} is not found")


def unknown_to_load(name: str) -> ModelNotFound:
    """A repository load of a name that is not a model of the repository: Triton's "failed
    to load" (its model-control examples look for it), then the unknown-model answer."""
    return ModelNotFound(f"failed to load {_shown(name)!r}, failed to poll from model "
                         f"repository: {unknown_model(name)}")


def no_available_versions(name: str, why: str = "") -> ModelNotFound:
    """A known model that serves nothing now (unloaded, or failed to load: ``why``)."""
    return ModelNotFound(f"Request for unknown model: {_shown(name)!r} has no available "
                         f"versions{f' ({why})' if why else ''}")


def requested_version(version: str) -> int | None:
    """A path's or request's model version as a number; None for "" (the latest).

    Anything but ASCII digits (a sign, spaces, other scripts' digits): 400, in Triton's
    words."""
    if not version:
        return None
    if version.startswith("-") and version[1:].isdigit() and version.isascii():
        raise InvalidInput(f"invalid model version specified {_shown(version)!r} , version "
                           "should be an integral value > 0")
    if not (version.isdigit() and version.isascii()):
        raise InvalidInput(f"failed to get model version from specified version string "
                           f"{_shown(version)!r} (details: not an integer), version should "
                           "be an integral value > 0")
    return int(version)


def unknown_version(name: str, version: int) -> ModelNotFound:
    return ModelNotFound(f"Request for unknown model: {_shown(name)!r} version {version} "
                         "is not found")


def _shown(text: str) -> str:
    """A client's name as error messages show it (cut past MAX_NAME_LENGTH)."""
    return text if len(text) <= MAX_NAME_LENGTH else text[:MAX_NAME_LENGTH] + "..."


def model_folder(root: Path, name: str) -> Path | None:
    """The folder of model ``name`` under ``root``, or None when the name is invalid, the
    folder is absent, or it resolves (through symlinks) outside ``root``."""
    if not valid_name(name):
        return None
    folder = root / name
    try:
        inside = folder.resolve().is_relative_to(root.resolve())
        return folder if inside and folder.is_dir() else None
    except OSError:
        return None


def require_folder(root: Path, name: str) -> Path:
    """:func:`model_folder`, raising :func:`unknown_model` instead of returning None."""
    folder = model_folder(root, name)
    if folder is None:
        raise unknown_model(name)
    return folder
