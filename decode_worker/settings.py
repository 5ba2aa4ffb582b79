"""Decode worker settings: a worker's (:class:`cluster.settings.WorkerSettings`) plus what only a
decode worker reads: its reservations' lease, how its streams batch tokens, whether it also
serves prefill for other decode workers, and how often it spot-checks received KV."""

from __future__ import annotations

from pydantic import Field

from cluster.settings import WorkerSettings
from kvtransfer import DEFAULT_LEASE_S


class DecodeWorkerSettings(WorkerSettings):
    """Settings of the decode worker process (flags and ``TANDEM_*`` variables, see :mod:`cluster.settings`)."""

    lease_s: float = Field(DEFAULT_LEASE_S, gt=0, le=600,
                           description="seconds a reservation lives with no transfer stream open on it and no "
                                       "Decode claiming it (the worker's own: no caller chooses it)")
    stream_interval: int = Field(1, ge=1, description="new tokens a stream message waits for (the last one of a "
                                                      "sample goes whatever it holds); more: fewer messages per "
                                                      "token for the worker's event loop, coarser streaming "
                                                      "(SGLang's stream_interval)")
    serves_prefill: bool = Field(False, description="also serve tandem.v1.PrefillWorker: prefill a prompt for "
                                                    "another decode worker and send it the KV, as a prefill "
                                                    "worker does, when the gateway's placement lends this "
                                                    "worker's GPUs (published as serves_prefill)")
    kv_spot_check_rate: float = Field(1 / 64, ge=0, le=1,
                                      description="share of transferred prompts whose KV is spot-checked: one "
                                                  "sampled received block recomputed here and compared before "
                                                  "the request decodes (a mismatch fails it over and quarantines "
                                                  "the prefill worker); a request the gateway asks for is "
                                                  "checked whatever the rate")
