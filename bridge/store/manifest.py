"""What a published version is: its manifest, and the errors of reading one (pydantic only).

A version's manifest (`LAYOUT.manifest_key`) is written last, after every array, and names
the step it was published at, the HF config, and per array its shape, dtype, chunk grid,
checksum (`bridge/store/chunk_digest.py`) and byte count. Readers trust nothing the
manifest does not vouch for.
"""

from __future__ import annotations

import time
from typing import Any

import pydantic

from bridge.store.chunk_digest import CHECKSUM_ALGORITHM
from bridge.store.layout import LAYOUT


class CorruptVersionError(ValueError):
    """A published version whose data does not match its manifest."""


class VersionNotFoundError(LookupError):
    """No manifest for this version (never published, still being written, or collected)."""


class VersionExistsError(ValueError):
    """Published versions are immutable."""


class ArrayInfo(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(frozen=True)

    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]
    checksum: str
    nbytes: int
    # Per-chunk digests (hex) in chunk order (what `checksum` is the SHA-256 of): a peer
    # relay verifies each chunk on arrival against them (bridge/broadcast/chunks.py).
    chunk_digests: tuple[str, ...] | None = None


class TensorPatch(pydantic.BaseModel):
    """How one tensor of a delta version is stored (bridge/weights/delta_codec.py).

    kind "same": bytes equal the base's, nothing stored; "patch": the changed elements
    (`nbytes` in all, BLAKE3 `digest` of the whole patch object); "dense": the whole tensor
    as an ordinary array (denser than `bridge.delta.max_density`).

    A patch no larger than the store's chunk size is one object at `LAYOUT.patch_key`
    (`pieces` None). A larger one (an 8B model's embedding patch is 25-35 MB) is stored as
    pieces of `piece_nbytes` bytes, the last one shorter, at `LAYOUT.patch_piece_key`, with
    each piece's BLAKE3 digest in `pieces`: a relay verifies and re-serves it piece by piece,
    so it pipelines over a chain like a tensor's chunks instead of crossing each hop whole."""

    model_config = pydantic.ConfigDict(frozen=True)

    kind: str = pydantic.Field(pattern="^(same|patch|dense)$")
    changed: int = pydantic.Field(ge=0)
    nbytes: int = pydantic.Field(ge=0)
    digest: str | None = None
    pieces: tuple[str, ...] | None = None
    piece_nbytes: int = pydantic.Field(default=0, ge=0)

    @pydantic.model_validator(mode="after")
    def _pieces_cover_the_patch(self) -> TensorPatch:
        if self.pieces is not None:
            count = -(-self.nbytes // self.piece_nbytes) if self.piece_nbytes else -1
            if self.kind != "patch" or len(self.pieces) != count or count < 2:
                raise ValueError(
                    f"{len(self.pieces)} patch pieces of {self.piece_nbytes} bytes cannot "
                    f"hold a {self.kind} of {self.nbytes} bytes"
                )
        return self

    @pydantic.model_serializer(mode="wrap")
    def _without_unused_pieces(self, handler):
        """A patch in one object is written as before pieces existed (manifests are
        fetched by every worker for every version: no bytes for fields not used)."""
        out = handler(self)
        if self.pieces is None and isinstance(out, dict):
            out.pop("pieces", None)
            out.pop("piece_nbytes", None)
        return out

    def objects(self, version: int, name: str) -> list[tuple[str, str | None, int]]:
        """(key, BLAKE3 digest, bytes) of each stored object of this patch, in order."""
        if self.kind != "patch":
            return []
        if self.pieces is None:
            return [(LAYOUT.patch_key(version, name), self.digest, self.nbytes)]
        last = self.nbytes - self.piece_nbytes * (len(self.pieces) - 1)
        sizes = [self.piece_nbytes] * (len(self.pieces) - 1) + [last]
        return [
            (LAYOUT.patch_piece_key(version, name, i), digest, size)
            for i, (digest, size) in enumerate(zip(self.pieces, sizes, strict=True))
        ]


class DeltaInfo(pydantic.BaseModel):
    """How a version is reached from its `base` (the previous published version).

    `tensors` patch the base into this version (bridge/weights/). `anchor` is the full version
    its chain starts from: this version itself when it is an anchor that also carries a
    patch on its base (so a reader one version behind crosses an anchor by its patch, not
    by downloading it whole). `nbytes` is what the patches (+ dense tensors) take, the cost of
    the hop base -> version. The manifest's `arrays` still describe the FULL tensors
    (checksums, chunk digests): a reader verifies what it reconstructed, not what it got."""

    model_config = pydantic.ConfigDict(frozen=True)

    base: int = pydantic.Field(ge=0)
    anchor: int = pydantic.Field(ge=0)
    nbytes: int = pydantic.Field(ge=0)
    density: float = pydantic.Field(ge=0.0, le=1.0)
    tensors: dict[str, TensorPatch]


class Manifest(pydantic.BaseModel):
    # The HF config is serialized under "model_config" (the name); pydantic reserves
    # that attribute name, so in Python it is `hf_config`.
    model_config = pydantic.ConfigDict(frozen=True, populate_by_name=True)

    version: int
    step: int
    created_at: float
    dtype: str
    total_bytes: int
    hf_config: dict[str, Any] = pydantic.Field(alias="model_config")
    arrays: dict[str, ArrayInfo]
    extra: dict[str, Any] = {}
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    delta: DeltaInfo | None = None  # None: a full version (an anchor)

    @property
    def anchor(self) -> int:
        """The full version this version's tensors are rebuilt from (itself if full)."""
        return self.version if self.delta is None else self.delta.anchor

    @property
    def is_full(self) -> bool:
        """Every tensor is stored under this version (an anchor, or a plain full version)."""
        return self.anchor == self.version

    @property
    def stored_bytes(self) -> int:
        """Bytes this version adds to the store."""
        extra = 0 if self.delta is None else self.delta.nbytes
        return (self.total_bytes if self.is_full else 0) + extra

    def to_json(self) -> bytes:
        return self.model_dump_json(by_alias=True, indent=1).encode()


def new_manifest(version, step, dtype, model_config, infos, extra, delta=None) -> Manifest:
    """The manifest of a version whose arrays (`infos`, name -> ArrayInfo) are all written
    (`delta`: a DeltaInfo when the version is stored as patches on a base version)."""
    return Manifest(
        version=version,
        step=step,
        created_at=time.time(),
        dtype=dtype,
        total_bytes=sum(i.nbytes for i in infos.values()),
        model_config=dict(model_config),
        arrays=infos,
        extra=dict(extra or {}),
        delta=delta,
    )
