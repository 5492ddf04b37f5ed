"""fla's Hopper guard (fla#640): the one place that knows it, lifts it and puts it back.

fla raises in its gated GDN backward (`chunk_bwd_dqkwg`) on Hopper with Triton >= 3.4, < 3.7.1:
a Triton miscompile at block width 64. Whether a model's head dims are affected is decided by the
self-check (it runs the kernel with the guard lifted against the fp32 reference); the guard is a
module global of fla's, the only switch it offers. Each lift names its owner (the `KernelSet` of
one patched model); the global returns to fla's own value when the last owner releases it, so
`unpatch_model` leaves fla as it found it.
"""

from __future__ import annotations

import contextlib

from ..ops import availability

TRITON_AFFECTED = ("3.4.0", "3.7.1")  # [from, to): the Triton releases fla#640 names
_MODULE = "fla.ops.common.chunk_o"
_owners: set[int] = set()
_original: bool | None = None  # fla's own TRITON_ABOVE_3_7_1 before the first lift


def _chunk_o():
    import importlib

    return importlib.import_module(_MODULE)


def active() -> bool:
    """Would fla refuse its gated backward here (Hopper + an affected Triton, guard in place)?"""
    with contextlib.suppress(Exception):
        chunk_o = _chunk_o()
        return bool(chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1)
    return False


def lift(owner: object) -> None:
    """Let fla run its gated backward (the caller's self-check decides whether that is right)."""
    global _original
    chunk_o = _chunk_o()
    if not _owners:
        _original = bool(chunk_o.TRITON_ABOVE_3_7_1)
    _owners.add(id(owner))
    chunk_o.TRITON_ABOVE_3_7_1 = True


def release(owner: object) -> None:
    """`owner` no longer needs the guard lifted; the last one restores fla's own value."""
    global _original
    if id(owner) not in _owners:
        return
    _owners.discard(id(owner))
    if not _owners and _original is not None:
        _chunk_o().TRITON_ABOVE_3_7_1 = _original
        _original = None


def lifted_by(owner: object) -> bool:
    return id(owner) in _owners


def triton_affected() -> bool:
    """The installed Triton is in the range fla#640 names (for `doctor`)."""
    from packaging.version import Version

    version = availability.version_of("triton")
    if version is None:
        return False
    return Version(TRITON_AFFECTED[0]) <= Version(version) < Version(TRITON_AFFECTED[1])
