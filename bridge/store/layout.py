"""Where a published version's manifest, arrays and chunks live under a store root.

The one home of the store's key layout: the writer (`weight_store.py`,
`sharded_publish.py`), the relays that move a version key by key (`bridge/broadcast/`,
`rollout_gpu/relay.py`) and every reader ask `LAYOUT`, so the keys cannot drift apart.

    manifests/{version:012d}.json              written last, create-if-absent: a version
                                               exists iff its manifest does
    data/{version:012d}/{hf_name}/             one zarr3 array per HF tensor
    data/{version:012d}/{hf_name}/c/{i}/{j}    its chunks (zarr3's default key encoding)
    data/{version:012d}/.parts/{process}.json  a multi-host publisher's record of its chunks
    data/{version:012d}/.delta/{hf_name}       a delta version's patch of one tensor (the
                                               changed elements vs its base, bridge/weights/);
                                               a dense-fallback tensor is an ordinary array
    data/{version:012d}/.delta/{hf_name}/{i}   or its pieces, when larger than a chunk

Version numbers are zero-padded so key order is numeric order: a range delete of
`data/{lo}` .. `data/{hi}` removes exactly the versions lo <= v < hi, and manifests live
under their own prefix so listing versions reads O(#versions) keys, not every chunk (that
listing is a paged LIST on S3/GCS).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class StoreLayout:
    """Key names of a weight store (relative to the store root, "/"-separated)."""

    manifests: str = "manifests/"
    data: str = "data/"
    parts: str = ".parts"
    delta: str = ".delta"
    digits: int = 12

    @property
    def max_version(self) -> int:
        """The largest version the zero-padded keys can order correctly."""
        return 10**self.digits - 1

    def version_key(self, version: int) -> str:
        return f"{version:0{self.digits}d}"

    def manifest_key(self, version: int) -> str:
        return f"{self.manifests}{self.version_key(version)}.json"

    def data_prefix(self, version: int) -> str:
        """The prefix of every array (and part file) of one version."""
        return f"{self.data}{self.version_key(version)}/"

    def array_prefix(self, version: int, name: str) -> str:
        """The zarr3 array of HF tensor `name` (a kvstore path ending in "/")."""
        return f"{self.data_prefix(version)}{name}/"

    def chunk_key(self, version: int, name: str, position: Sequence[int]) -> str:
        """The stored object of one chunk at grid `position`."""
        return self.array_prefix(version, name) + "c/" + "/".join(map(str, position))

    def part_key(self, version: int, process: int) -> str:
        return f"{self.data_prefix(version)}{self.parts}/{process:05d}.json"

    def patch_key(self, version: int, name: str) -> str:
        """The patch of tensor `name` in delta version `version` (under its data prefix, so
        garbage collection and crash-debris cleanup remove it with the version's arrays)."""
        return f"{self.data_prefix(version)}{self.delta}/{name}"

    def patch_piece_key(self, version: int, name: str, index: int) -> str:
        """Piece `index` of a patch larger than a chunk (bridge/store/manifest.py:
        TensorPatch.pieces), stored instead of the one object at `patch_key`."""
        return f"{self.patch_key(version, name)}/{index}"

    def manifest_range(self) -> tuple[str, str]:
        """(inclusive_min, exclusive_max) of every manifest key."""
        return self.manifests, self.manifests[:-1] + chr(ord(self.manifests[-1]) + 1)

    def data_range(self, lo: int, hi: int) -> tuple[str, str]:
        """(inclusive_min, exclusive_max) of every data key of versions lo <= v < hi."""
        hi = min(hi, self.max_version)
        return f"{self.data}{self.version_key(lo)}", f"{self.data}{self.version_key(hi)}"

    def listed_version(self, stem: str) -> int | None:
        """The version of a manifest listed with the manifests prefix stripped."""
        if stem.endswith(".json") and stem[:-5].isdigit():
            return int(stem[:-5])
        return None

    def version_of(self, key: str) -> int | None:
        """The version a store key belongs to (None for keys outside the layout)."""
        if key.startswith(self.manifests) and "/" not in key[len(self.manifests) :]:
            return self.listed_version(key[len(self.manifests) :])
        if key.startswith(self.data):
            stem, sep, _ = key[len(self.data) :].partition("/")
            return int(stem) if sep and stem.isdigit() else None
        return None


LAYOUT = StoreLayout()
