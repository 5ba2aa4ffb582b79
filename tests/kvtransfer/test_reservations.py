"""Reserved blocks leave the table exactly once: claimed by the request or freed to the pool."""

import asyncio

import grpc
import pytest

from kvtransfer import ReservationTable
from protos.status import StatusError


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_table(lease_s: float = 30.0) -> tuple[ReservationTable, list[int], FakeClock]:
    freed: list[int] = []
    clock = FakeClock()
    return ReservationTable(freed.extend, lease_s=lease_s, clock=clock), freed, clock


def write(table: ReservationTable, reservation_id: str, request_id: str, first: int, count: int) -> list[int]:
    """A whole write: begun, bytes in place, ended."""
    reservation, block_ids = table.begin_write(reservation_id, request_id, first, count)
    table.end_write(reservation)
    return block_ids


def test_complete_reservation_is_claimed_without_freeing() -> None:
    table, freed, _ = make_table()
    r = table.reserve("req", [7, 3, 5])
    assert write(table, r.reservation_id, "req", 1, 2) == [3, 5]
    with pytest.raises(StatusError) as info:
        table.claim(r.reservation_id, "req")
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "2 of 3" in info.value.message
    write(table, r.reservation_id, "req", 0, 1)
    assert table.claim(r.reservation_id, "req") == [7, 3, 5]
    assert freed == [] and len(table) == 0


def test_cached_positions_count_as_arrived() -> None:
    table, _, _ = make_table()
    r = table.reserve("req", [7, 3, 5], num_cached=2)
    with pytest.raises(StatusError, match="already arrived"):
        table.begin_write(r.reservation_id, "req", 1, 1)
    write(table, r.reservation_id, "req", 2, 1)
    assert table.claim(r.reservation_id, "req") == [7, 3, 5]


def test_a_release_during_a_write_frees_the_blocks_after_it() -> None:
    """An Abort while a NIXL read is in flight: the reservation is gone at once, its blocks are
    freed only when the read has ended (never re-allocated under a transfer)."""
    table, freed, _ = make_table()
    r = table.reserve("req", [4, 6])
    reservation, _ = table.begin_write(r.reservation_id, "req", 0, 2)
    with pytest.raises(StatusError):  # nobody can claim a reservation still being written
        table.claim(r.reservation_id, "req")
    assert table.release(r.reservation_id, "aborted") and len(table) == 0
    assert freed == []
    table.end_write(reservation)
    assert freed == [4, 6]


def test_duplicate_out_of_range_and_foreign_request_are_refused() -> None:
    table, _, _ = make_table()
    r = table.reserve("req", [0, 1])
    write(table, r.reservation_id, "req", 0, 1)
    cases = [((0, 1), "already arrived"), ((1, 2), "outside [0, 2)"), ((-1, 1), "outside"), ((1, 0), "outside")]
    for (first, count), text in cases:
        with pytest.raises(StatusError, match=r"INVALID_ARGUMENT") as info:
            table.begin_write(r.reservation_id, "req", first, count)
        assert text in info.value.message
    with pytest.raises(StatusError, match="belongs to request 'req'"):
        table.begin_write(r.reservation_id, "other", 1, 1)


def test_one_reservation_per_request_and_distinct_blocks() -> None:
    table, _, _ = make_table()
    table.reserve("req", [0])
    with pytest.raises(StatusError) as info:
        table.reserve("req", [1])
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(StatusError, match="distinct"):
        table.reserve("other", [2, 2])


def test_expired_lease_frees_blocks_once() -> None:
    table, freed, clock = make_table(lease_s=30.0)
    short = table.reserve("a", [1, 2], lease_s=5.0)
    table.reserve("b", [3])
    clock.now += 10.0
    assert table.expire() == [short.reservation_id]
    assert freed == [1, 2] and table.num_reserved_blocks == 1
    assert table.expire() == [] and freed == [1, 2]


def test_lookup_after_lease_end_frees_even_without_expire() -> None:
    table, freed, clock = make_table(lease_s=1.0)
    r = table.reserve("a", [4])
    clock.now += 1.0
    with pytest.raises(StatusError) as info:
        table.begin_write(r.reservation_id, "a", 0, 1)
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert freed == [4] and len(table) == 0


def test_abort_by_request_is_idempotent() -> None:
    table, freed, _ = make_table()
    table.reserve("a", [1, 2])
    assert table.release_request("a", "client cancelled") is True
    assert table.release_request("a", "again") is False
    assert freed == [1, 2]


def test_expiry_task_frees_on_real_clock() -> None:
    async def scenario() -> list[int]:
        freed: list[int] = []
        table = ReservationTable(freed.extend, lease_s=0.05)
        table.reserve("a", [9])
        task = asyncio.create_task(table.run_expiry(interval_s=0.01))
        await asyncio.sleep(0.2)
        task.cancel()
        return freed

    assert asyncio.run(scenario()) == [9]


def test_release_all_frees_every_reservation_once() -> None:
    table, freed, _ = make_table()
    table.reserve("a", [1, 2])
    table.reserve("b", [3])
    assert table.release_all("shutting down") == 2
    assert sorted(freed) == [1, 2, 3] and len(table) == 0
    assert table.release_all("again") == 0 and sorted(freed) == [1, 2, 3]
