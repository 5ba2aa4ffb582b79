"""Gateway settings: the shared ones (:class:`cluster.settings.ServerSettings`) plus what only the
gateway reads. The cache settings (block size, ``max_model_len``, KV dtype, block-hash seed)
are not here: the workers own and publish them, and the gateway reads them from the pool.
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, field_validator

from cluster.settings import CommaSeparated, ServerSettings, setting_name, split_commas
from gateway.auth import ApiKeys

Addresses = CommaSeparated  # host:port,...
ApiKeyEntries = CommaSeparated  # SHA256HEX:TENANT[:MAX_STREAMS],... (gateway.auth)


class GatewaySettings(ServerSettings):
    """Settings of the gateway process (flags and ``TANDEM_*`` variables, see :mod:`cluster.settings`)."""

    listen: str = Field("127.0.0.1:50051", validation_alias="TANDEM_GATEWAY_ADDR",
                        description="host:port the public gRPC API binds to")
    metrics_port: int = Field(9400, ge=0, le=65535, description="Prometheus /metrics port, on the listen host; 0: off")
    reflection: bool = Field(True, description="serve gRPC reflection of the public API (grpcurl describe)")
    chat_split_special_tokens: bool = Field(True, description="chat message content is tokenized with special "
                                                              "tokens as plain text (only the template makes them)")
    static_prefill: Addresses = Field([], description="prefill addresses host:port,... when there is no Redis")
    static_decode: Addresses = Field([], description="decode addresses host:port,... when there is no Redis")
    refresh_interval_s: float = Field(0.5, gt=0, description="seconds between reads of the workers and their load")
    admit_wait_s: float = Field(5.0, ge=0, description="seconds a request waits for decode capacity before RESOURCE_EXHAUSTED")
    local_prefill_max_tokens: int = Field(
        256, ge=0, description="conditional disaggregation: the decode worker prefills a prompt itself when at most "
                               "this many tokens are left after its prefix-cache hit (no prefill worker, no KV transfer)")
    prefill_placement: Literal["adaptive", "static"] = Field(
        "adaptive", description="where a prompt is prefilled: adaptive (predicted TTFT and ITL against the objectives, "
                                "gateway.placement) or static (a prefill worker whenever one can take it, except "
                                "below local_prefill_max_tokens: a fixed split)")
    slo_ttft_s: float = Field(0.0, ge=0, allow_inf_nan=False,
                              description="time-to-first-token objective of a request, seconds (0: none; a request's "
                                          "slo.ttft_s overrides it): where a prompt is prefilled is chosen to meet it")
    slo_itl_s: float = Field(0.0, ge=0, allow_inf_nan=False,
                             description="inter-token latency objective, seconds (0: none; a request's slo.itl_s "
                                         "overrides it): a decode worker running requests prefills a prompt itself "
                                         "only when their predicted ITL stays within it")
    slo_tpot_s: float = Field(0.0, ge=0, allow_inf_nan=False,
                              description="time-per-output-token objective (the mean over a stream after its first "
                                          "token), seconds (0: none; a request's slo.tpot_s overrides it): a decode "
                                          "worker running requests prefills a prompt itself only when each of this "
                                          "gateway's streams there is predicted to keep its mean within it")
    prefill_timeout_s_per_token: float = Field(
        0.05, gt=0, description="a prefill's timeout is hop_timeout_s plus this many seconds per prompt token until "
                                "the gateway has measured the worker's own pace (then 4x that pace)")
    max_request_bytes: int = Field(4 << 20, ge=1024, description="serialized request size at most (larger: INVALID_ARGUMENT)")
    max_prompt_bytes: int = Field(256 << 10, ge=1, description="UTF-8 bytes of prompt text (prompt, or all chat "
                                                              "messages) at most, checked before tokenization "
                                                              "(larger: INVALID_ARGUMENT)")
    tokenizer_threads: int = Field(2, ge=1, description="threads that tokenize prompts (off the event loop)")
    tokenizer_queue: int = Field(64, ge=0, description="prompts waiting for a tokenizer thread at most (more: "
                                                       "RESOURCE_EXHAUSTED)")
    # Failover (docs/deployment.md, "Failures"): the gateway drives the worker calls.
    hop_timeout_s: float = Field(60.0, gt=0, description="seconds one worker call (Admit, Prefill) may take when "
                                                         "the client's deadline is later or unset")
    decode_stall_timeout_s: float = Field(15.0, gt=0, description="seconds a Decode stream may go without a "
                                                                  "message before its worker counts as failed")
    max_retries: int = Field(2, ge=0, description="tries on other workers after a worker failure before the "
                                                  "client has seen a token, and resumes of a greedy or seeded "
                                                  "stream on another decode worker after it")
    outlier_consecutive_failures: int = Field(2, ge=1, description="consecutive failed calls that eject a worker "
                                                                   "from routing")
    outlier_base_ejection_s: float = Field(5.0, gt=0, description="seconds of a worker's first ejection; each "
                                                                  "repeat doubles it")
    outlier_max_ejection_s: float = Field(60.0, gt=0, description="seconds an ejection lasts at most")
    quarantine_s: float = Field(600.0, gt=0, description="seconds a prefill worker caught sending wrong KV by a "
                                                         "decode worker's spot check is not routed to (every "
                                                         "gateway of the deployment, through Redis), and then "
                                                         "has each of its requests spot-checked as long again")
    health_probe_interval_s: float = Field(1.0, gt=0, description="seconds between the gateway's health probes "
                                                                  "of each worker")
    health_probe_timeout_s: float = Field(1.0, gt=0, description="seconds a health probe waits; no SERVING "
                                                                 "answer in time: not routed to until one comes")

    # OpenAI-compatible HTTP API (gateway.openai_api), beside the gRPC port, with its TLS and API keys.
    http_addr: str = Field("", description="host:port of the OpenAI-compatible HTTP API (/v1/chat/completions, "
                                           "/v1/completions, /v1/models, /health); empty: off")

    api_keys: ApiKeyEntries = Field([], description="API keys as SHA256HEX:TENANT[:MAX_STREAMS],... (none here "
                                                    "or in api_keys_file: the gateway is open)")
    api_keys_file: str = Field("", description="file of API keys, one SHA256HEX:TENANT[:MAX_STREAMS] per line")
    allow_open: bool = Field(False, description="serve without API keys on an address other than loopback (every "
                                                "caller of the network may generate)")

    _split_commas = field_validator("static_prefill", "static_decode", "api_keys", mode="before")(split_commas)

    @field_validator("outlier_max_ejection_s")
    @classmethod
    def _check_max_ejection(cls, value: float, info) -> float:
        base = info.data.get("outlier_base_ejection_s")
        if base is not None and value < base:
            raise ValueError(f"must be >= outlier_base_ejection_s ({base}), got {value}")
        return value

    @field_validator("api_keys")
    @classmethod
    def _check_api_keys(cls, value: list[str]) -> list[str]:
        ApiKeys.parse(value, "api_keys")
        return value

    @field_validator("api_keys_file")
    @classmethod
    def _check_api_keys_file(cls, value: str) -> str:
        ApiKeys.load([], value, "api_keys", "api_keys_file")
        return value

    def load_api_keys(self) -> ApiKeys:
        """The configured API keys (``api_keys`` and ``api_keys_file``, read now)."""
        return ApiKeys.load(self.api_keys, self.api_keys_file, "api_keys", "api_keys_file")

    def check_open_access(self) -> None:
        """Refuse to serve every caller of a network nobody chose to open: listening on an
        address other than loopback with no API key needs ``allow_open``.

        Raises:
            ValueError: the message names the listen address and the three settings.
        """
        if self.allow_open or len(self.load_api_keys()):
            return
        host = self.listen_host
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:  # a host name: it may resolve to any interface
            loopback = False
        if not loopback:
            cls = type(self)
            raise ValueError(f"{setting_name(cls, 'listen')} is {self.listen} (not loopback) and no API key is set: "
                             f"set {setting_name(cls, 'api_keys')} or {setting_name(cls, 'api_keys_file')} "
                             f"(`tandem apikey TENANT`), or serve everyone with {setting_name(cls, 'allow_open')}")
