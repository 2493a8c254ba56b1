"""bridge/weights/delta_reconstruct.py at the edges that mutation testing found untested
(`make mutants MODULES=bridge/weights/delta_reconstruct.py`): the reload set after a dense hop and
from an anchor with a copy in hand, the caller's copy left untouched, a subset of names,
bytes read and priced (`path_bytes`), a tie between the two paths, the first version."""

import numpy as np
import pytest
from delta_chain_test import SHAPES, _bits, _publish_run

from bridge.store.weight_store import WeightStore
from bridge.weights.delta_reconstruct import choose_path, full_bytes, hop_bytes, links, path_bytes
from bridge.weights.delta_reconstruct import reconstruct as rebuild


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    store = WeightStore(str(tmp_path_factory.mktemp("store") / "store"))
    _, reference = _publish_run(store, 10, anchor_every=6, max_density=0.3)
    return store, reference


def _same(a, b):
    return a.shape == b.shape and (_bits(a) == _bits(b)).all()


def test_dense_hop_is_in_the_reload_set(run):
    store, ref = run
    assert store.manifest(5).delta.tensors["q"].kind == "dense"  # q moves densely at 5
    got = rebuild(store, 5, have=(4, ref[4]))
    assert got.path == [5] and "q" in got.changed
    assert all(_same(got.tensors[n], ref[5][n]) for n in SHAPES)


def test_from_the_anchor_with_a_copy_in_hand_reloads_only_what_differs(run):
    store, ref = run
    # The copy's version (99) is on no chain: the anchor path, compared with the copy.
    got = rebuild(store, 9, have=(99, ref[8]))
    assert got.path == [6, 7, 8, 9]
    want = {n for n in SHAPES if not _same(ref[8][n], ref[9][n])}
    assert "norm" not in want  # norm stays put on odd versions
    assert got.changed == want
    # A copy without some tensor: those are reloaded too.
    partial = {n: a for n, a in ref[8].items() if n != "norm"}
    assert rebuild(store, 9, have=(99, partial)).changed == want | {"norm"}


def test_the_callers_copy_is_not_patched(run):
    store, ref = run
    copy = {n: a.copy() for n, a in ref[2].items()}
    got = rebuild(store, 9, have=(2, copy))
    assert got.path == list(range(3, 10))
    assert all(_same(copy[n], ref[2][n]) for n in SHAPES)
    assert all(_same(got.tensors[n], ref[9][n]) for n in SHAPES)


def test_a_subset_of_names(run):
    store, ref = run
    got = rebuild(store, 9, names=["q"])
    assert set(got.tensors) == {"q"} and _same(got.tensors["q"], ref[9]["q"])
    with pytest.raises(KeyError, match="no arrays"):
        rebuild(store, 9, names=["q", "nope"])


def test_bytes_read_and_priced(run):
    store, ref = run
    late = rebuild(store, 9)
    want = store.manifest(6).total_bytes + sum(store.manifest(v).delta.nbytes for v in (7, 8, 9))
    assert late.path == [6, 7, 8, 9] and late.bytes_read == want
    assert path_bytes(store, 9) == want
    hops = rebuild(store, 9, have=(8, ref[8]))
    assert path_bytes(store, 9, 8) == hops.bytes_read == store.manifest(9).delta.nbytes


def test_a_tie_keeps_the_copy_in_hand(run):
    store, _ = run
    chain = links(store, 9, 2)
    fulls = [m for m in chain if m.is_full]
    from_anchor = chain[chain.index(fulls[-1]) :]
    # Price the first hop so that both paths download exactly the same bytes.
    rest = hop_bytes(chain[1:])
    first = chain[0].delta.model_copy(update={"nbytes": full_bytes(from_anchor) - rest})
    tied = [chain[0].model_copy(update={"delta": first})] + chain[1:]
    from_full, path = choose_path(tied, 2)
    assert not from_full and path == tied


def test_the_first_version_has_no_base(run):
    store, ref = run
    got = rebuild(store, 0)
    assert got.path == [0] and all(_same(got.tensors[n], ref[0][n]) for n in SHAPES)


def test_a_copy_differing_in_one_element_or_in_shape_is_reloaded(run):
    store, ref = run
    copy = {n: a.copy() for n, a in ref[9].items()}
    copy["q"].view(np.uint16)[3, 5] ^= 1  # one bit of one element
    assert rebuild(store, 9, have=(99, copy)).changed == {"q"}
    copy = {**ref[9], "norm": ref[9]["norm"][:32].copy()}  # same dtype, other shape
    assert rebuild(store, 9, have=(99, copy)).changed == {"norm"}


def test_an_anchor_alone_is_priced_whole(run):
    store, _ = run
    assert path_bytes(store, 6) == store.manifest(6).total_bytes
