"""Arrays and devices: what kind of array a buffer is and where it lives."""

from __future__ import annotations

import re

__all__ = ["check_device"]

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def check_device(device: object, name: str = "device") -> str:
    """Return `device` if it is a device string (``"cpu"``, ``"cuda"``, ``"cuda:N"``), else raise.

    Raises
    ------
    TypeError
        If `device` is not a string.
    ValueError
        If the string names no device.
    """
    if not isinstance(device, str):
        raise TypeError(f"{name} must be a str such as 'cpu' or 'cuda:0', got {type(device).__name__}")
    if not _DEVICE.fullmatch(device):
        raise ValueError(f"{name} must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return device
