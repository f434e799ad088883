"""flashlib.testing.ring: the ring attention harness, run by run_local on two ranks, and its refusal
without a process group."""
import datetime
import socket

import pytest
import torch
import torch.distributed as dist

from flashlib.backends import BACKENDS
from flashlib.parallel.launch import run_local
from flashlib.parallel.ring import _mode, chunk_ids
from flashlib.testing.ring import check_against_single_process, check_cases


def _expected_blocks(rank, world, causal, layout):
    """Block pairs ``rank`` hands to the backend: the ring's schedule, from chunk_ids and _mode."""
    mine = chunk_ids(rank, world, layout)
    return sum(_mode(a, b, causal) != "skip"
               for step in range(world) for b in chunk_ids((rank - step) % world, world, layout)
               for a in mine)


def test_check_against_single_process_on_two_ranks():
    cases = [dict(causal=True, layout="contiguous", heads=4, kv_heads=1, shard_len=5, head_dim=40),
             dict(causal=True, layout="zigzag", heads=2, kv_heads=2, shard_len=6, head_dim=59),
             dict(causal=False, layout="zigzag", heads=3, kv_heads=1, shard_len=4, head_dim=8,
                  dtype=torch.float32)]
    results = run_local(check_cases, 2, cases, timeout=120)
    for rank, per_case in enumerate(results):
        for case, r in zip(cases, per_case):
            tol = 1e-10 if case.get("dtype", torch.float64) == torch.float64 else 1e-5
            assert set(r) == {"max_error", "oracle_error", "baseline_error", "blocks"}
            assert set(r["max_error"]) == {"o", "dq", "dk", "dv"}
            for key in r["max_error"]:
                assert r["max_error"][key] < tol, (rank, case, r)
                assert r["oracle_error"][key] < tol, (rank, case, r)
                assert 0 < r["baseline_error"][key] < tol, (rank, case, r)   # rounding, not zero
            want = _expected_blocks(rank, 2, case["causal"], case["layout"])
            assert r["blocks"] == {"forward": want, "backward": want}, (rank, case, r)
    # contiguous causal: rank 0 skips the future block, rank 1 computes both
    assert [per_case[0]["blocks"]["forward"] for per_case in results] == [1, 2]


def test_check_against_single_process_needs_the_group():
    with pytest.raises(RuntimeError, match="initialized process group of 2 ranks"):
        check_cases(0, 2, [dict(causal=False, layout="contiguous")])


def test_in_a_ring_of_one_the_harness_counts_blocks_and_leaves_the_registry_as_it_was():
    """In this process (a group of one rank): the counting backend is known only while the ring runs."""
    before = dict(BACKENDS)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        r = check_against_single_process(0, 1, True, "zigzag", heads=2, kv_heads=1, shard_len=4,
                                         head_dim=8, backend="reference")
    finally:
        dist.destroy_process_group()
    assert BACKENDS == before
    assert r["blocks"] == {"forward": 3, "backward": 3}        # zigzag chunks 0, 1: (0,0) (1,0) (1,1)
    assert max(r["max_error"].values()) < 1e-10 and max(r["oracle_error"].values()) < 1e-10



@pytest.mark.parametrize("args, kwargs, error, message", [
    ((2, 2, False, "contiguous"), {}, ValueError, r"rank must be an int from 0 to 1 .*got 2"),
    ((0, 0, False, "contiguous"), {}, ValueError, r"world must be an int >= 1"),
    ((0, 2, "no", "contiguous"), {}, TypeError, r"causal must be a bool, got str 'no'"),
    ((0, 2, False, "ring"), {}, ValueError, r"layout must be one of"),
    ((0, 2, False, "contiguous"), dict(batch=0), ValueError, r"batch must be an int >= 1, got 0"),
    ((0, 2, False, "contiguous"), dict(heads=2.0), TypeError, r"heads must be an int, got float"),
    ((0, 2, False, "contiguous"), dict(heads=3, kv_heads=2), ValueError, r"kv_heads must divide heads=3"),
    ((0, 2, False, "contiguous"), dict(shard_len=-1), ValueError, r"shard_len must be an int >= 1"),
    ((0, 2, False, "zigzag"), dict(shard_len=3), ValueError, r"shard_len must be even with the zigzag"),
    ((0, 2, False, "contiguous"), dict(head_dim=300), ValueError, r"head_dim must be an int from 1 to 256"),
    ((0, 2, False, "contiguous"), dict(dtype="float64"), TypeError, r"dtype must be torch.float16"),
    ((0, 2, False, "contiguous"), dict(dtype=torch.int32), TypeError, r"dtype must be .*got torch.int32"),
    ((0, 2, False, "contiguous"), dict(seed=1.5), TypeError, r"seed must be an int, got float"),
    ((0, 2, False, "contiguous"), dict(backend=None), TypeError, r"backend must be a str, got NoneType"),
])
def test_the_harness_refuses_bad_arguments_before_it_needs_the_group(args, kwargs, error, message):
    """Before: a negative shard_len or a float heads failed deep in torch.randn, and a rank past the world
    in shard()'s IndexError; now each is refused by name, before the process group is looked at."""
    with pytest.raises(error, match=message):
        check_against_single_process(*args, **kwargs)


@pytest.mark.parametrize("cases, error, message", [
    (dict(causal=False, layout="contiguous"), TypeError, r"cases must be a list of dicts .*got dict"),
    ("contiguous", TypeError, r"cases must be a list of dicts .*got str"),
    (3, TypeError, r"cases must be a list of dicts .*got int"),
    ([("causal", False)], TypeError, r"cases\[0\] must be a dict .*got tuple"),
    ([dict(causal=False)], ValueError, r"cases\[0\] must name causal and layout, missing \['layout'\]"),
])
def test_check_cases_refuses_what_is_no_list_of_cases(cases, error, message):
    with pytest.raises(error, match=message):
        check_cases(0, 2, cases)
