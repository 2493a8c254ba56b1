"""Reading a version that may be stored as deltas: path choice, patching, verification.

    got = reconstruct(store, target, have=(version, tensors))   # a worker's host copy
    got.tensors, got.changed, got.path, got.bytes_read

A delta version's manifest names its base and its anchor (bridge/store/manifest.py:
DeltaInfo). From the version `have` it serves, a reader reaches `target` either by the
deltas after `have` (when `have` is on target's chain) or from target's anchor plus every
delta after it; `choose_path` takes the one with fewer bytes to download. Patches are
verified against their digest as they are read, dense tensors by the store's own chunk
checksums, and at the end EVERY reconstructed tensor against the target manifest's
checksum of the full tensor: a tampered patch, a tampered anchor or a corrupted base in the
reader's memory is refused (CorruptVersionError naming the tensor). `have`'s arrays are
never modified: a patched tensor is a copy, an unchanged one is shared.

`WeightStore.read` reads every version through `read_version`, so every reader of the store
(the export, a relay, the tests) sees full tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from bridge.store.chunk_digest import array_checksum, digest_bytes
from bridge.store.manifest import CorruptVersionError, Manifest, VersionNotFoundError
from bridge.weights import delta_codec as codec


@dataclasses.dataclass
class Reconstructed:
    tensors: dict[str, np.ndarray]
    changed: set[str]  # names whose bytes may differ from `have`'s (all without a `have`)
    path: list[int]  # versions read, in order (the first is an anchor or `have`'s successor)
    bytes_read: int


def links(store, target: int, have: int | None = None) -> list[Manifest]:
    """Manifests from target back along its bases, oldest first: to the successor of `have`
    when `have` is on the chain (crossing anchors by their patches; `have`'s own manifest is
    not read, so a relay need not hold it), else to target's nearest anchor."""
    out = [store.manifest(target)]
    while out[-1].version != have:
        m = out[-1]
        if m.delta is None or (m.is_full and (have is None or m.delta.base < have)):
            break  # a full version with no way (or no need) to go further back
        if m.delta.base >= m.version or len(out) > 100_000:
            raise CorruptVersionError(f"version {m.version}: base {m.delta.base} is not older")
        if m.delta.base == have:
            break  # the reader holds the base
        try:
            out.append(store.manifest(m.delta.base))
        except VersionNotFoundError:
            if not any(x.is_full for x in out):
                raise  # no anchor reached: the chain is broken (gc keeps it; never expected)
            break  # `have` is older than what the store keeps: take the anchor
    return out[::-1]


def choose_path(chain: list[Manifest], have: int | None) -> tuple[bool, list[Manifest]]:
    """(from_full, versions to read): the deltas after `have` when it is on `chain`, or the
    nearest anchor read whole and the deltas after it, whichever downloads fewer bytes."""
    fulls = [i for i, m in enumerate(chain) if m.is_full]
    from_anchor = chain[fulls[-1] :] if fulls else None
    start = _after(chain, have)
    if start is not None:
        from_have = chain[start:]
        if from_anchor is None or hop_bytes(from_have) <= full_bytes(from_anchor):
            return False, from_have
    if from_anchor is None:
        raise CorruptVersionError(f"version {chain[-1].version}: no anchor on its chain")
    return True, from_anchor


def _after(chain: list[Manifest], have: int | None) -> int | None:
    """Where the versions after `have` start in `chain` (None: `have` is not on it)."""
    if have is None:
        return None
    if chain[-1].version == have:
        return len(chain)  # on the target already: nothing to read
    first = chain[0].delta
    return 0 if first is not None and first.base == have else None


def hop_bytes(path: list[Manifest]) -> int:
    return sum(m.delta.nbytes for m in path)


def full_bytes(path: list[Manifest]) -> int:
    return path[0].total_bytes + hop_bytes(path[1:])


def path_bytes(store, target: int, have: int | None = None) -> int:
    """Bytes a reader on `have` downloads to reach `target` (what the planner prices)."""
    from_full, path = choose_path(links(store, target, have), have)
    return full_bytes(path) if from_full else hop_bytes(path)


def reconstruct(
    store,
    target: int,
    names: Iterable[str] | None = None,
    have: tuple[int, Mapping[str, np.ndarray]] | None = None,
) -> Reconstructed:
    """Every tensor of `target` (or `names`), verified against its manifest."""
    have_version, have_tensors = have if have is not None else (None, None)
    final = store.manifest(target)
    names = list(final.arrays if names is None else names)
    unknown = [n for n in names if n not in final.arrays]
    if unknown:
        raise KeyError(f"version {target} has no arrays {unknown[:5]}")
    if have_tensors is None or any(n not in have_tensors for n in names):
        have_version = None  # no (complete) copy in hand: it cannot be a base
    from_full, path = choose_path(links(store, target, have_version), have_version)
    if from_full:
        tensors = dict(store.read_stored(path[0].version, names))
        changed, hops, bytes_read = set(names), path[1:], path[0].total_bytes
    else:
        tensors = {n: have_tensors[n] for n in names}
        changed, hops, bytes_read = set(), path, 0
    owned: set[str] = set()  # tensors copied already: patch in place from then on
    for link in hops:
        bytes_read += link.delta.nbytes
        dense = [n for n in names if link.delta.tensors[n].kind == "dense"]
        for name, array in store.read_stored(link.version, dense):
            tensors[name] = array
            owned.add(name)
        for name in names:
            patch = link.delta.tensors[name]
            if patch.kind != "patch":
                changed.update([name] if patch.kind == "dense" else [])
                continue
            try:
                idx, values = codec.decode_patch(
                    _patch_blob(store, link, name), tensors[name].size, tensors[name].dtype
                )
            except codec.PatchError as e:
                raise CorruptVersionError(f"version {link.version}: {name}: {e}") from e
            if name in owned:
                codec.patch_in_place(tensors[name], idx, values)
            else:
                tensors[name] = codec.apply_patch(tensors[name], idx, values)
                owned.add(name)
            changed.add(name)
    if from_full and have_tensors is not None:
        # From the anchor with a copy in hand: tensors equal to it need no reload.
        changed = {
            n for n in names if n not in have_tensors or _differs(have_tensors[n], tensors[n])
        }
    for name in names:
        _verify(final, name, tensors[name])
    return Reconstructed(tensors, changed, [m.version for m in path], bytes_read)


def read_version(
    store, version: int, names: Iterable[str] | None = None, depth: int = 8
) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) of any version, verified: what is stored under it when it is stored
    whole (a full or adapter version, an anchor), else rebuilt from its anchor. Only a delta
    version is ever stored otherwise, so this reads every kind (`WeightStore.read`)."""
    if store.manifest(version).is_full:
        return store.read_stored(version, names, depth)
    return iter(reconstruct(store, version, names).tensors.items())


def _patch_blob(store, link: Manifest, name: str) -> bytes:
    """The patch object of `name` in `link`, each piece and the whole checked against the
    manifest's digests."""
    patch = link.delta.tensors[name]
    objects = patch.objects(link.version, name)
    reads = [store.kv.read(key) for key, _, _ in objects]  # all pieces in flight at once
    parts = []
    for (key, digest, nbytes), read in zip(objects, reads, strict=True):
        r = read.result()
        if r.state != "value":
            raise CorruptVersionError(f"version {link.version}: patch of {name} is missing")
        part = bytes(r.value)
        if len(part) != nbytes or digest_bytes(part) != digest:
            raise CorruptVersionError(
                f"version {link.version}: patch of {name} ({key}) does not match its digest "
                "(tampered or torn)"
            )
        parts.append(part)
    blob = b"".join(parts)
    if len(blob) != patch.nbytes or digest_bytes(blob) != patch.digest:
        raise CorruptVersionError(
            f"version {link.version}: patch of {name} does not match its digest (tampered or torn)"
        )
    return blob


def _differs(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape != b.shape or a.dtype != b.dtype or codec.changed_indices(a, b).size > 0


def _verify(manifest: Manifest, name: str, array: np.ndarray) -> None:
    info = manifest.arrays[name]
    if array.shape != info.shape or array.dtype.name != info.dtype:
        raise CorruptVersionError(
            f"version {manifest.version}: {name} rebuilt as {array.dtype.name}{list(array.shape)}"
            f", manifest says {info.dtype}{list(info.shape)}"
        )
    if array_checksum(array, info.chunks) != info.checksum:
        raise CorruptVersionError(
            f"version {manifest.version}: reconstructed {name} does not match the manifest's "
            f"checksum (a tampered patch or base)"
        )
