"""Reading a ``config.yaml`` into the mapping it holds: YAML errors, duplicate keys and a
document that is not a mapping are one :class:`ConfigError` naming the line. What the
keys mean is :mod:`batching.config_schema`'s job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from batching.config_schema import ConfigError, kind_of, short_repr


def read_config_yaml(model: str, path: Path) -> dict[str, Any]:
    """The mapping in the ``config.yaml`` at ``path`` of model folder ``model``."""
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{model}: config.yaml cannot be read ({exc.strerror})") from None
    return parse_yaml(model, text)


def parse_yaml(model: str, text: bytes) -> dict[str, Any]:
    """The mapping a ``config.yaml`` holds (empty for an empty file)."""
    try:
        node, document = _load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = ", ".join(text for text in (exc.context, exc.problem) if text)
        raise ConfigError(f"{model}: config.yaml{where}: {reason}") from None
    except yaml.reader.ReaderError as exc:
        line = text[:exc.position].count(b"\n") + 1
        raise ConfigError(f"{model}: config.yaml line {line}: not UTF-8 text or a special "
                          f"character ({exc.reason})") from None
    except RecursionError:
        raise ConfigError(f"{model}: config.yaml nests too deeply") from None
    if node is None or document is None:
        return {}
    twice = _duplicate_key(node)
    if twice is not None:
        raise ConfigError(f"{model}: config.yaml line {twice.start_mark.line + 1}: duplicate "
                          f"key {short_repr(twice.value)}")
    if not isinstance(document, dict):
        raise ConfigError(f"{model}: config.yaml line {node.start_mark.line + 1}: must be a "
                          f"mapping of keys, got {kind_of(document)}")
    return document


def _load(text: bytes) -> tuple[yaml.Node | None, Any]:
    """The document's root node (for its line) and the document (None when empty)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        return node, None if node is None else loader.construct_document(node)
    finally:
        loader.dispose()


def _duplicate_key(root: yaml.Node) -> yaml.Node | None:
    """The first key that repeats within one mapping (YAML forbids it; PyYAML keeps the last)."""
    stack, visited = [root], set()
    while stack:
        node = stack.pop()
        if id(node) in visited:
            continue
        visited.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys: set[tuple[str, str]] = set()
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value != "<<":
                    if (key.tag, key.value) in keys:
                        return key
                    keys.add((key.tag, key.value))
                stack += [key, value]
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value
    return None
