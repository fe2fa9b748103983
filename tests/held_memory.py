"""What an object really holds in tensor memory, measured by walking it (not a test module).

``held_storages(obj)`` follows attributes, dataclass fields, dicts, lists and tuples from ``obj`` and
returns every tensor storage it reaches, by the path of the first tensor seen on it. Sizes are those
of the *storages* (``untyped_storage().nbytes()``), the memory allocated, so a small view that keeps a
large buffer alive counts the whole buffer, and a buffer reached twice counts once.
"""

from __future__ import annotations

import torch


def held_storages(obj, path: str = "") -> dict[str, torch.UntypedStorage]:
    found: dict[str, torch.UntypedStorage] = {}
    storages: set[int] = set()
    visited: set[int] = set()

    def walk(node, where: str) -> None:
        if node is None or isinstance(node, (bool, int, float, str, bytes, type)) or id(node) in visited:
            return
        visited.add(id(node))
        if isinstance(node, torch.Tensor):
            storage = node.untyped_storage()
            if storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                found[where] = storage
            return
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{where}[{key!r}]")
        elif isinstance(node, (list, tuple, set)):
            for i, value in enumerate(node):
                walk(value, f"{where}[{i}]")
        elif hasattr(node, "__dict__"):
            for key, value in vars(node).items():
                walk(value, f"{where}.{key}")

    walk(obj, path)
    return found


def held_bytes(obj) -> int:
    """Bytes of every tensor storage reachable from ``obj``."""
    return sum(storage.nbytes() for storage in held_storages(obj).values())


def storage_addresses(obj) -> dict[str, int]:
    """Path -> address of every storage reachable from ``obj`` (equal addresses: written in place)."""
    return {where: storage.data_ptr() for where, storage in held_storages(obj).items()}
