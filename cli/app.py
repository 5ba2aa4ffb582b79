"""The ``tandem`` command line.

Servers: ``tandem gateway``, ``tandem prefill``, ``tandem decode`` (each reads ``TANDEM_*``
variables; flags win), ``tandem serve --local`` (a whole cluster on loopback until Ctrl-C) and
``tandem demo`` (the same, one chat prompt answered, then a clean shutdown). Clients of a
running gateway: ``tandem generate "..."`` and ``tandem chat``. In-process engine:
``tandem offline-chat``. Capacity planning: ``tandem plan`` (prefill and decode workers for a workload
and its SLOs, from measured rates).
"""

from __future__ import annotations

import logging
import os
import runpy
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(help="Tandem: disaggregated prefill/decode LLM serving over gRPC.", no_args_is_help=True,
                  pretty_exceptions_enable=False, rich_markup_mode=None)
console = Console()
err_console = Console(stderr=True)

_LAUNCHED = time.perf_counter()  # the command's start (this module is the CLI's first import)
DEMO_PROMPT = "What is the capital of France? Answer in one sentence, then name two sights there."
_WORKER_PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@app.command("offline-chat")
def offline_chat(
    message: str = typer.Argument(..., help="The user message."),
    model: str = typer.Option(None, help="HF directory, GGUF file, ORG/NAME or preset (default: SmolLM2-135M-Instruct)."),
    max_tokens: int = typer.Option(128, min=1, help="New tokens at most."),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy."),
    system: str = typer.Option(None, help="Optional system prompt."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Answer one chat message with the in-process engine, streaming the reply."""
    _setup_logging(verbose)
    from engine import EngineCore, SamplingParams
    from engine.output_processor import OutputProcessor

    engine = EngineCore(model)
    if engine.tokenizer is None:
        err_console.print(f"[red]error:[/red] model {engine.model_id} has no tokenizer")
        raise typer.Exit(2)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": message}
    ]
    processor = OutputProcessor(engine)
    processor.add_request("cli", engine.tokenizer.apply_chat_template(messages),
                          SamplingParams(max_tokens=max_tokens, temperature=temperature))
    console.print(f"[bold]user:[/bold] {message}\n[bold]assistant:[/bold] ", end="")
    printed = 0
    while engine.has_unfinished_requests:
        for out in processor.process(engine.step().outputs):
            text = out.outputs[0].text
            console.print(text[printed:], end="", markup=False, highlight=False)
            printed = len(text)
    console.print()


# ----------------------------------------------------------------------------- servers


def _run_worker(module: str, args: list[str]) -> None:
    sys.argv = [f"python -m {module}", *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


@app.command("gateway", context_settings=_WORKER_PASSTHROUGH, add_help_option=False)
def gateway_cmd(ctx: typer.Context) -> None:
    """Run the public gRPC gateway (all flags go to `python -m gateway`; try `tandem gateway --help`)."""
    _run_worker("gateway", ctx.args)


@app.command("prefill", context_settings=_WORKER_PASSTHROUGH, add_help_option=False)
def prefill_cmd(ctx: typer.Context) -> None:
    """Run a prefill worker (all flags go to `python -m prefill_worker`; try `tandem prefill --help`)."""
    _run_worker("prefill_worker", ctx.args)


@app.command("decode", context_settings=_WORKER_PASSTHROUGH, add_help_option=False)
def decode_cmd(ctx: typer.Context) -> None:
    """Run a decode worker (all flags go to `python -m decode_worker`; try `tandem decode --help`)."""
    _run_worker("decode_worker", ctx.args)


def _run_local(model: str | None, listen: str, prefill: int, decode: int, once: str | None, max_tokens: int,
               temperature: float, timeout_s: float, quiet: bool, quiet_after_ready: bool = False,
               insecure: bool = False, http: str | None = None, speculative_config: str | None = None,
               **placement) -> int:
    """Start a LocalCluster, then answer ``once`` or serve until a signal; stop it. Returns an exit code.
    ``placement`` (``gpus``, ``prefill_tp``, ``decode_tp``, ``decode_serves_prefill``) goes to the
    LocalCluster; ``http``: the address of the OpenAI-compatible HTTP API (``None``: a free
    loopback port, ``""``: off); ``speculative_config``: the decode workers' (JSON,
    ``EngineConfig.speculative_config``).

    Unless ``insecure``, a fresh CA and certificates are made in a temporary directory (removed
    on exit): the gateway serves TLS and its clients trust that directory's ``ca.pem``.
    """
    import shutil
    import tempfile

    from rich.markup import escape

    from cli.launcher import ClusterError, LocalCluster
    from cluster.tls import init_certs

    tls_dir = None
    if insecure:
        err_console.print("[yellow]--insecure: the gateway and the workers speak plaintext[/yellow]")
    else:
        tls_dir = tempfile.mkdtemp(prefix="tandem-certs-")
        init_certs(tls_dir)
    ca_file = os.path.join(tls_dir, "ca.pem") if tls_dir else ""

    _setup_logging(False)
    styles = ["cyan", "magenta", "green", "yellow", "blue"]
    colors: dict[str, str] = {}

    ready = threading.Event()

    def sink(name: str, line: str) -> None:
        line = line.rsplit("\r", 1)[-1]  # a progress bar: its latest state only
        important = any(word in line for word in ("WARNING", "ERROR", "Traceback", "Error"))
        if not line.strip() or (not important and (quiet or (quiet_after_ready and ready.is_set()))):
            return
        color = colors.setdefault(name, styles[len(colors) % len(styles)])
        err_console.print(f"[{color}]{name:>9}[/{color}] | {escape(line)}", highlight=False, soft_wrap=True)

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        spec_env = {"TANDEM_SPECULATIVE_CONFIG": speculative_config} if speculative_config else {}
        cluster = LocalCluster(model=model, gateway_addr=listen, http_addr=http, num_prefill=prefill,
                               num_decode=decode, sink=sink, tls_dir=tls_dir,
                               worker_env={f"decode-{i}": spec_env for i in range(decode)}, **placement)
    except ValueError as exc:
        err_console.print(f"[red]{exc}[/red]")
        return 2
    try:
        with err_console.status("starting the local cluster (loading the model)...") as status:
            cluster.start(timeout_s=timeout_s, on_wait=lambda text: status.update(text))
        ready.set()
        ports = ", ".join(f"{name} :{port}" for name, port in cluster.metrics_ports.items())
        err_console.print(f"[bold green]cluster ready[/bold green]: gateway at {cluster.gateway_addr} "
                          f"({prefill} prefill + {decode} decode, redis {cluster.redis_url or 'none'}; "
                          f"metrics {ports})")
        if cluster.http_addr:
            err_console.print(f"OpenAI-compatible API at {'https' if tls_dir else 'http'}://{cluster.http_addr}/v1",
                              highlight=False)
        phases = cluster.phases
        err_console.print(f"start-up: {time.perf_counter() - _LAUNCHED:.1f} s since launch (model files "
                          f"{phases['model_files_s']:.1f} s, processes ready {phases['processes_ready_s']:.1f} s)")
        if ca_file:
            err_console.print(f"TLS: clients trust {ca_file} (export TANDEM_TLS_CA={ca_file})", highlight=False)
        if once is not None:
            first: list[float] = []
            code = _ask(cluster.gateway_addr, [{"role": "user", "content": once}], max_tokens, temperature, echo=True,
                        ca_file=ca_file, on_first_text=lambda: first.append(time.perf_counter()))[0]
            if first:
                err_console.print(f"first token {first[0] - _LAUNCHED:.1f} s after launch")
            return code
        err_console.print("serving; Ctrl-C stops everything")
        while not stop.wait(0.5):
            if dead := cluster.dead():
                err_console.print(f"[red]{', '.join(dead)} exited; shutting the cluster down[/red]")
                return 1
        return 0
    except ClusterError as exc:
        err_console.print(f"[red]cluster failed:[/red] {exc}")
        return 1
    finally:
        err_console.print("stopping the cluster...")
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if tls_dir:
            shutil.rmtree(tls_dir, ignore_errors=True)
        err_console.print("stopped")


@app.command("serve")
def serve_cmd(
    local: bool = typer.Option(False, "--local", help="Start Redis, workers and a gateway on this machine."),
    model: str = typer.Option(None, help="Model for every process (default SmolLM2-135M-Instruct)."),
    listen: str = typer.Option("127.0.0.1:50051", help="The gateway's address."),
    http: str = typer.Option("127.0.0.1:8000", help="The gateway's OpenAI-compatible HTTP API address (\"\": off)."),
    prefill: int = typer.Option(1, min=0, help="Prefill workers (0: the decode workers prefill themselves)."),
    decode: int = typer.Option(1, min=1, help="Decode workers."),
    once: str = typer.Option(None, help="Answer this one chat prompt, then shut down."),
    max_tokens: int = typer.Option(128, min=1, help="With --once: new tokens at most."),
    temperature: float = typer.Option(0.0, min=0.0, help="With --once: 0 = greedy."),
    timeout: float = typer.Option(600, help="Seconds to wait for every process to be SERVING."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Show only warnings and errors of the processes."),
    insecure: bool = typer.Option(False, "--insecure", help="Plaintext instead of TLS/mTLS with a fresh local CA."),
    gpus: int = typer.Option(0, min=0, help="GPUs of this host to place the workers on, each on as many consecutive "
                                            "GPUs as its tensor-parallel size (0: every worker's own device setting)."),
    prefill_tp: int = typer.Option(1, min=1, help="Tensor-parallel size of each prefill worker."),
    decode_tp: int = typer.Option(1, min=1, help="Tensor-parallel size of each decode worker."),
    decode_serves_prefill: bool = typer.Option(
        False, "--decode-serves-prefill", help="Every decode worker also serves prefill for the others "
                                               "(TANDEM_SERVES_PREFILL: adaptive placement may lend it a prompt)."),
    speculative_config: str = typer.Option(
        None, help="The decode workers' speculative decoding, JSON (e.g. '{\"method\": \"ngram\", "
                   "\"num_speculative_tokens\": 4}'; the workers' --speculative-config)."),
) -> None:
    """Run a whole cluster locally (Redis, 1 prefill, 1 decode, gateway) until Ctrl-C / SIGTERM."""
    if not local:
        err_console.print("only --local is implemented; for a multi-host deployment run `tandem gateway`, "
                          "`tandem prefill` and `tandem decode` (see docs/deployment.md)")
        raise typer.Exit(2)
    raise typer.Exit(_run_local(model, listen, prefill, decode, once, max_tokens, temperature, timeout, quiet,
                                insecure=insecure, http=http, gpus=gpus, prefill_tp=prefill_tp, decode_tp=decode_tp,
                                decode_serves_prefill=decode_serves_prefill,
                                speculative_config=speculative_config))


@app.command("demo")
def demo_cmd(
    prompt: str = typer.Argument(DEMO_PROMPT, help="The chat prompt."),
    model: str = typer.Option(None, help="Model (default SmolLM2-135M-Instruct)."),
    listen: str = typer.Option(None, help="The gateway's address (default: a free loopback port)."),
    max_tokens: int = typer.Option(128, min=1, help="New tokens at most."),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Show only warnings and errors of the processes."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Keep showing the processes' logs after startup."),
    insecure: bool = typer.Option(False, "--insecure", help="Plaintext instead of TLS/mTLS with a fresh local CA."),
) -> None:
    """Start the local cluster, stream the answer to one chat prompt through the gateway, shut down.

    The processes' logs show while the model loads; once the cluster is ready only their
    warnings and errors do (``--verbose``: everything), so the answer reads cleanly.
    """
    from cli.launcher import free_port

    listen = listen or f"127.0.0.1:{free_port()}"
    raise typer.Exit(_run_local(model, listen, 1, 1, prompt, max_tokens, temperature, 600, quiet,
                                quiet_after_ready=not verbose, insecure=insecure))


# ----------------------------------------------------------------------------- clients


# A call refused for these reasons fails the same way on every try: `chat` stops on them.
_FATAL_CODES = ("UNAUTHENTICATED", "PERMISSION_DENIED")


def _ask(addr: str, messages: list[dict[str, str]], max_tokens: int, temperature: float,
         prompt: str | None = None, echo: bool = False, ca_file: str = "", api_key: str = "",
         on_first_text: Callable[[], None] | None = None) -> tuple[int, str]:
    """Stream one answer to the terminal; returns an exit code (0, 1 on a failed call, 130 when
    interrupted) and the failed call's status name (``""`` when none). Appends the answer to
    ``messages``. ``echo`` prints the user's message first; ``ca_file``: the CA that verifies
    the gateway's TLS certificate (default ``TANDEM_TLS_CA``); ``api_key``: sent as
    ``authorization: Bearer`` (default ``TANDEM_API_KEY``). The ``assistant:`` label is printed
    with the answer's first text, so a failed call prints only its error; ``on_first_text`` is
    called then too."""
    import grpc

    from cli import client
    from protos.tandem.v1 import gateway_pb2

    params = client.sampling(max_tokens, temperature)
    request = (gateway_pb2.GenerateRequest(prompt=prompt, sampling=params) if prompt is not None
               else client.chat_request(messages, params))
    if echo:
        console.print(f"[bold]user:[/bold] {messages[-1]['content']}")
    labelled = False

    def show(text: str) -> None:
        nonlocal labelled
        if not labelled:
            if on_first_text is not None:
                on_first_text()
            console.print("[bold]assistant:[/bold] ", end="")
            labelled = True
        console.print(text, end="", markup=False, highlight=False)

    try:
        out = client.stream(addr, request, show, api_key=api_key or os.environ.get("TANDEM_API_KEY", ""),
                            ca_file=ca_file)
    except OSError as exc:  # the CA file
        err_console.print(f"[red]error:[/red] cannot read the CA file: {exc}", highlight=False)
        return 1, ""
    except grpc.RpcError as exc:
        if labelled:
            console.print()
        err_console.print(f"[red]{exc.code().name}[/red]: {exc.details()}", highlight=False, soft_wrap=True)
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            err_console.print(client.tls_hint(ca_file), highlight=False, soft_wrap=True)
        return 1, exc.code().name
    except KeyboardInterrupt:
        console.print("\n[dim](cancelled)[/dim]")
        return 130, ""
    if not labelled:
        show("")
    console.print()
    usage = out.usage
    if usage is not None:
        err_console.print(f"[dim]{out.finish_reason.removeprefix('FINISH_REASON_').lower()}, "
                          f"{usage.prompt_tokens} prompt tokens ({usage.cached_prompt_tokens} cached), "
                          f"{usage.completion_tokens} generated[/dim]")
    messages.append({"role": "assistant", "content": out.text})
    return 0, ""


certs_app = typer.Typer(help="The cluster's CA and certificates (`tandem certs init`, `tandem certs issue`).",
                        no_args_is_help=True)
app.add_typer(certs_app, name="certs")


@certs_app.command("init")
def certs_init_cmd(
    directory: str = typer.Argument(..., help="Where to write the CA and the certificates."),
    san: list[str] = typer.Option(
        [], "--san", "--name", envvar="TANDEM_GATEWAY_SANS", show_envvar=True,
        help="More DNS names or IP addresses of the gateway's certificate, comma-separated (repeatable): "
             "the names its clients dial."),
    days: int = typer.Option(825, min=1, help="Validity, days."),
) -> None:
    """`tandem certs init DIR`: a development CA and a certificate per role (gateway, prefill,
    decode) for TANDEM_TLS_DIR; clients of the gateway trust DIR/ca.pem (TANDEM_TLS_CA). A worker
    registered in Redis needs a certificate of its own instance (`tandem certs issue`). Prints the
    files written, one per line."""
    from cluster.tls import init_certs, split_names

    _print_written(lambda: init_certs(directory, split_names(san, "--san / TANDEM_GATEWAY_SANS"), days))


@certs_app.command("issue")
def certs_issue_cmd(
    ca_dir: str = typer.Argument(..., help="The CA's directory (`tandem certs init`: ca.pem and ca-key.pem)."),
    role: str = typer.Argument(..., help="prefill or decode."),
    instance: str = typer.Argument(..., help="The worker id the instance registers under (TANDEM_WORKER_ID)."),
    out_dir: str = typer.Option(..., "--out", help="The instance's TLS directory to write (its TANDEM_TLS_DIR)."),
    days: int = typer.Option(825, min=1, help="Validity, days."),
) -> None:
    """`tandem certs issue CA_DIR ROLE INSTANCE --out DIR`: a certificate naming one worker instance
    (URI spiffe://tandem/ROLE/INSTANCE besides the role's names) with the CA certificate, and no CA
    key, in DIR: the gateway routes to a registry entry only if its address presents the
    certificate of its worker id. Prints the files written, one per line."""
    from cluster.tls import issue_instance_cert

    _print_written(lambda: issue_instance_cert(ca_dir, role, instance, out_dir, days))


def _print_written(make: Callable[[], list]) -> None:
    """Run ``make`` (it writes files, returns their paths) and print the paths; a ValueError is
    one red line and exit code 2."""
    try:
        written = make()
    except ValueError as exc:
        err_console.print(str(exc), style="red", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    for path in written:
        print(path)  # not through rich: a file gets whole lines, never wrapped at 80 columns


@app.command("apikey")
def apikey_cmd(
    tenant: str = typer.Argument(..., help="The tenant the key belongs to (letters, digits, . _ -)."),
    max_streams: int = typer.Option(0, min=0, help="The tenant's concurrent calls at most (0: no limit)."),
) -> None:
    """Make a random API key: prints the key (give it to the client, as TANDEM_API_KEY) and, on
    stderr, the line for the gateway's TANDEM_API_KEYS_FILE (its SHA-256, never the key)."""
    import secrets

    from gateway.auth import ApiKeys, hash_key

    key = secrets.token_urlsafe(32)
    entry = f"{hash_key(key)}:{tenant}" + (f":{max_streams}" if max_streams else "")
    try:
        ApiKeys.parse([entry], "tenant")
    except ValueError as exc:
        err_console.print(str(exc), style="red", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    # Not through rich: a file gets whole lines, never wrapped at 80 columns.
    print(key)
    print(entry, file=sys.stderr)


_REPO = Path(__file__).resolve().parents[1]


def _positive(value: float) -> float:
    if not value > 0:
        raise typer.BadParameter(f"must be > 0, got {value}")
    return value


@app.command("plan")
def plan_cmd(
    gpus: int = typer.Option(..., min=1, help="GPUs of the host or cluster, all used."),
    workload: str = typer.Option(
        ..., help="A serving benchmark workload (random, long, interference, decode_heavy) or "
                  "FRACTION:MIN-MAX:OUTPUT[,...]: shares of requests with prompts of MIN-MAX tokens and OUTPUT "
                  "tokens generated."),
    ttft: float = typer.Option(..., callback=_positive, help="TTFT objective, seconds."),
    tpot: float = typer.Option(..., callback=_positive, help="TPOT objective, seconds."),
    attainment: float = typer.Option(0.9, max=1.0, callback=_positive,
                                     help="Share of the requests that must meet both objectives."),
    rates: Path = typer.Option(_REPO / "deploy" / "plan" / "llama-3-8b-h200.json",
                               help="Measured rates of the model on the GPU (deploy/plan/)."),
    local_prefill_max_tokens: int = typer.Option(
        256, min=0, help="The gateway's TANDEM_LOCAL_PREFILL_MAX_TOKENS: shorter prompts prefill on their "
                         "decode worker."),
    compose_override: Path = typer.Option(None, help="Write a Compose override of --compose-file for the layout."),
    compose_file: Path = typer.Option(_REPO / "docker-compose.yml", help="The Compose file it overrides."),
    kubernetes_overlay: Path = typer.Option(None, help="Write a kustomize overlay for the layout into this "
                                                       "directory."),
    kubernetes_dir: Path = typer.Option(_REPO / "deploy" / "kubernetes",
                                        help="The directory of the base and secrets the overlay builds on."),
    top: int = typer.Option(12, min=1, help="Candidates listed at most."),
) -> None:
    """Choose the prefill and decode workers (counts and TP sizes) of GPUS GPUs with the most
    predicted goodput per GPU for a workload and its SLOs, from measured rates (cli/planner.py
    describes the model); print the candidates compared and write the layout's Compose
    override and/or Kubernetes overlay. Exits 1, saying why, when no layout can meet the
    objectives."""
    from rich.table import Table

    from cli.plan_files import compose_override as override_text, kubernetes_overlay as overlay_files
    from cli.planner import ImpossibleObjectives, Objectives, Rates, parse_workload, plan

    try:
        chosen = plan(gpus, parse_workload(workload), Rates.load(rates), Objectives(ttft, tpot, attainment),
                      local_prefill_max_tokens)
    except (ImpossibleObjectives, ValueError, OSError) as exc:
        err_console.print(f"error: {exc}", style="red", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    best = chosen.best
    table = Table(title=f"{workload} on {gpus} GPUs at TTFT <= {ttft:g} s, TPOT <= {tpot * 1e3:g} ms "
                        f"({attainment:.0%} of requests)")
    for column in ("layout", "goodput (req/s)", "per GPU (req/s)", "bound past it"):
        table.add_column(column, justify="left" if column in ("layout", "bound past it") else "right")
    for c in chosen.candidates[:top]:
        table.add_row(("* " if c is best else "  ") + c.layout.label, f"{c.goodput_rps:.3g}", f"{c.per_gpu_rps:.3g}",
                      c.bound)
    Console(width=120).print(table)
    summary = (f"chosen: {best.layout.label}, predicted goodput {best.goodput_rps:.3g} req/s "
               f"({best.per_gpu_rps:.3g} per GPU) for {workload} at TTFT <= {ttft:g} s, TPOT <= {tpot:g} s, "
               f"from {rates.name}; written by `tandem plan`.")
    print(summary)
    if compose_override is not None:
        try:
            text = override_text(best.layout, compose_file, f"{summary}\n\n  docker compose -f {compose_file.name} "
                                                            f"-f {compose_override.name} up -d")
        except (OSError, KeyError) as exc:
            err_console.print(f"error: cannot read the services of {compose_file}: {exc}", style="red", markup=False)
            raise typer.Exit(1) from None
        compose_override.write_text(text)
        print(f"wrote {compose_override}")
    if kubernetes_overlay is not None:
        kubernetes_overlay.mkdir(parents=True, exist_ok=True)
        for name, text in overlay_files(best.layout, kubernetes_overlay, kubernetes_dir,
                                        f"{summary}\n\n  kubectl apply -k {kubernetes_overlay}").items():
            (kubernetes_overlay / name).write_text(text)
        print(f"wrote {kubernetes_overlay}/kustomization.yaml")


_GATEWAY_ADDR = typer.Option("127.0.0.1:50051", envvar="TANDEM_GATEWAY_ADDR", show_envvar=True,
                             help="Gateway address.")
_TLS_CA = typer.Option("", "--tls-ca", envvar="TANDEM_TLS_CA", show_envvar=True, show_default=False,
                       help="CA certificate that verifies the gateway's TLS (the ca.pem of its certificate "
                            "directory; `tandem serve --local` prints it). Unset: plaintext.")
_API_KEY = typer.Option("", "--api-key", envvar="TANDEM_API_KEY", show_envvar=True, show_default=False,
                        help="API key sent as `authorization: Bearer KEY` (when the gateway has TANDEM_API_KEYS).")


@app.command("generate")
def generate_cmd(
    prompt: str = typer.Argument(..., help="The prompt."),
    addr: str = _GATEWAY_ADDR,
    max_tokens: int = typer.Option(128, min=1, help="New tokens at most."),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy."),
    chat: bool = typer.Option(True, "--chat/--raw", help="Apply the chat template (default) or send raw text."),
    tls_ca: str = _TLS_CA,
    api_key: str = _API_KEY,
) -> None:
    """Stream a completion of PROMPT from a running gateway."""
    messages = [{"role": "user", "content": prompt}]
    raise typer.Exit(_ask(addr, messages, max_tokens, temperature, None if chat else prompt, ca_file=tls_ca,
                          api_key=api_key)[0])


@app.command("chat")
def chat_cmd(
    addr: str = _GATEWAY_ADDR,
    max_tokens: int = typer.Option(256, min=1, help="New tokens at most per answer."),
    temperature: float = typer.Option(0.7, min=0.0, help="0 = greedy."),
    system: str = typer.Option(None, help="Optional system prompt."),
    tls_ca: str = _TLS_CA,
    api_key: str = _API_KEY,
) -> None:
    """Chat with a running gateway (keeps the history; empty line or Ctrl-D ends). Exits 1 when
    the gateway cannot be reached or refuses the caller (UNAUTHENTICATED, PERMISSION_DENIED)."""
    from cli import client
    from cli.healthcheck import check

    try:
        serving = check(addr, timeout_s=5.0, ca_file=tls_ca)
    except OSError as exc:
        err_console.print(f"[red]error:[/red] cannot read the CA file: {exc}", highlight=False)
        raise typer.Exit(1) from None
    if not serving:
        err_console.print(f"[red]error:[/red] no serving gateway at {addr}; {client.tls_hint(tls_ca)}",
                          highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    messages = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            text = console.input("[bold green]you>[/bold green] ").strip()
        except (EOFError, KeyboardInterrupt):
            console.print()
            return
        if not text:
            return
        messages.append({"role": "user", "content": text})
        code, status = _ask(addr, messages, max_tokens, temperature, ca_file=tls_ca, api_key=api_key)
        if code != 0:
            messages.pop()
            if status in _FATAL_CODES or not check(addr, timeout_s=5.0, ca_file=tls_ca):
                raise typer.Exit(1)


def main(argv: list[str] | None = None) -> None:
    """The ``tandem`` command: every usage error is one line on stderr and exit code 2; a
    command's own failure exits non-zero (1) after one line saying why."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        code = app(argv or ["--help"], prog_name="tandem", standalone_mode=False)
    except typer.Abort:
        code = 130
    except typer.TyperException as exc:  # usage errors (bad option, bad value, missing argument)
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        print(f"tandem: error: {message} (--help lists the options)", file=sys.stderr)
        code = getattr(exc, "exit_code", 2)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
