"""Reserved blocks leave the table exactly once: claimed by the request or freed to the pool."""

import asyncio

import grpc
import pytest

from kvtransfer import KVTransferError, ReservationTable


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_table(lease_s: float = 30.0) -> tuple[ReservationTable, list[int], FakeClock]:
    freed: list[int] = []
    clock = FakeClock()
    return ReservationTable(freed.extend, lease_s=lease_s, clock=clock), freed, clock


def test_complete_reservation_is_claimed_without_freeing() -> None:
    table, freed, _ = make_table()
    r = table.reserve("req", [7, 3, 5])
    assert table.check_arrival(r.reservation_id, "req", 1, 2) == [3, 5]
    table.mark_arrived(r.reservation_id, 1, 2)
    with pytest.raises(KVTransferError) as info:
        table.claim(r.reservation_id, "req")
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "2 of 3" in info.value.message
    table.mark_arrived(r.reservation_id, 0, 1)
    assert table.claim(r.reservation_id, "req") == [7, 3, 5]
    assert freed == [] and len(table) == 0


def test_duplicate_out_of_range_and_foreign_request_are_refused() -> None:
    table, _, _ = make_table()
    r = table.reserve("req", [0, 1])
    table.mark_arrived(r.reservation_id, 0, 1)
    cases = [((0, 1), "already arrived"), ((1, 2), "outside [0, 2)"), ((-1, 1), "outside"), ((1, 0), "outside")]
    for (first, count), text in cases:
        with pytest.raises(KVTransferError, match=r"INVALID_ARGUMENT") as info:
            table.check_arrival(r.reservation_id, "req", first, count)
        assert text in info.value.message
    with pytest.raises(KVTransferError, match="belongs to request 'req'"):
        table.check_arrival(r.reservation_id, "other", 1, 1)


def test_one_reservation_per_request_and_distinct_blocks() -> None:
    table, _, _ = make_table()
    table.reserve("req", [0])
    with pytest.raises(KVTransferError) as info:
        table.reserve("req", [1])
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(KVTransferError, match="distinct"):
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
    with pytest.raises(KVTransferError) as info:
        table.check_arrival(r.reservation_id, "a", 0, 1)
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
