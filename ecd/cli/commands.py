"""The `ecd` command line (typer)."""
from __future__ import annotations

import contextlib
import enum
import logging
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Iterator, NamedTuple, NoReturn, Optional

import typer

from .. import __version__
from .output import (percent, print_json, render_bench, render_evict, render_keys, render_status,
                         stderr_console, stdout_console)
from ..config import ControlSection, dumps_toml, load_config_file
from ..config_types import client_endpoint, parse_size
from ..errors import (AuthenticationFailed, ConfigError, DaemonUnavailable, EcdError, InvalidEndpoint,
                      SocketPermissionDenied)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="ecd: per-node tensor hand-off daemon for disaggregated LLM serving.")

EXIT_OK, EXIT_DAEMON, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


class BenchOp(str, enum.Enum):
    put = "put"
    get = "get"
    both = "both"


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(f"ecd: {message}", err=True)
    raise typer.Exit(code)


def _setup_logging(level: str) -> None:
    # Under journald (JOURNAL_STREAM set) the journal adds its own timestamps.
    fmt = "%(levelname)s %(name)s: %(message)s" if os.environ.get("JOURNAL_STREAM") else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level.upper(), format=fmt, stream=sys.stderr)


@app.command()
def serve(config: Path = typer.Option(..., "--config", "-c", help="node.toml"),
          log_level: Optional[str] = typer.Option(None, "--log-level", help="overrides node.log_level")) -> None:
    """Run the daemon in the foreground until SIGINT/SIGTERM."""
    from ..daemon.server import Daemon, StartupError
    try:
        cfg = load_config_file(config)
    except ConfigError as exc:
        _fail(f"config error: {exc}", EXIT_USAGE)
    _setup_logging(log_level or cfg.node.log_level)
    daemon = Daemon(cfg, str(config))
    try:
        daemon.prepare()
    except StartupError as exc:
        # one line per problem (preflight may find several), each as `ecd doctor` words it
        for line in str(exc).splitlines()[:-1]:
            typer.echo(f"ecd: cannot start: {line}", err=True)
        _fail(f"cannot start: {str(exc).splitlines()[-1] if str(exc) else exc}", EXIT_USAGE)
    daemon.run()


@app.command()
def doctor(config: Annotated[Optional[Path], typer.Option(
               "--config", "-c", help="node.toml [default: the built-in defaults]", show_default=False)] = None,
           quiet: Annotated[bool, typer.Option("--quiet", "-q", help="print problems only")] = False,
           uid: Annotated[Optional[int], typer.Option(
               "--uid", help="also say what a client of this uid needs to connect", show_default=False)] = None) -> None:
    """Check that this node can run the daemon as configured, one line per finding with its fix:
    the pool against the cgroup's memory limit and /dev/shm, RLIMIT_MEMLOCK where the pool is
    pinned, RLIMIT_NOFILE against limits.max_connections, the socket directory against node.group
    and [control] allowed_uids/allowed_gids, CUDA where [pool.cuda] is set. Run it as the daemon's
    user, where the daemon runs (in its container: its cgroup and /dev/shm are the ones checked).

    Exit 0 when `ecd serve` would start (warnings included), 1 when it would refuse, 2 for a
    config that does not load."""
    from ..config import load_config
    from ..daemon.ops.security import check_security
    from .doctor import Finding, check_uid, preflight
    try:
        cfg = load_config_file(config) if config is not None else load_config({})
    except ConfigError as exc:
        _fail(f"config error: {exc}", EXIT_USAGE)
    findings: list[Finding] = []
    try:
        gid, _ = check_security(cfg)
    except ConfigError as exc:
        key, _, message = str(exc).partition(": ")
        findings.append(Finding("error", key, message))
        gid = os.getegid()
    findings += preflight(cfg, gid)
    if uid is not None:
        findings += check_uid(cfg, gid, uid)
    for finding in findings:
        if finding.level != "ok" or not quiet:
            typer.echo(f"{finding.level}: {finding.line()}", err=finding.level != "ok")
    errors = sum(f.level == "error" for f in findings)
    warnings = sum(f.level == "warning" for f in findings)
    if errors:
        _fail(f"doctor: {errors} error(s), {warnings} warning(s): `ecd serve` would refuse to start", EXIT_DAEMON)
    typer.echo(f"OK ({warnings} warning(s))" if warnings else "OK")


@app.command()
def hold(node: str = typer.Option(..., "--node", help="node.name of the daemon whose pool to hold"),
         runtime_dir: Path = typer.Option(..., "--runtime-dir", help="node.runtime_dir: the holder socket goes there"),
         hold_s: float = typer.Option(300.0, "--hold", help="seconds to keep the pool once no daemon holds it")) -> None:
    """Hold the node's host pool while no daemon runs (restart.keeper = "holder"): a sidecar or unit of its own."""
    from ..daemon.restart.holder import run
    raise typer.Exit(run(node, str(runtime_dir.absolute()), hold_s))


@app.command()
def release(config: Path = typer.Option(..., "--config", "-c", help="node.toml of the node whose pool to let go")) -> None:
    """A final stop's second half: the holder of this node's pool ([restart] keeper = "auto",
    "spawn" or "holder") lets it go now instead of keeping it `hold` seconds for the next daemon:
    its memory returns to the machine. Under systemd, `systemctl stop` does this by itself.
    Exit 0 when a holder let go or none was holding, 1 when the holder refused."""
    from ..daemon.restart.holder_client import HolderKeeper
    from ..daemon.restart.keeper import KeeperUnavailable
    try:
        cfg = load_config_file(config)
    except ConfigError as exc:
        _fail(f"config error: {exc}", EXIT_USAGE)
    keeper = HolderKeeper(cfg.node.name, cfg.node.runtime_dir, spawn=False)
    try:
        keeper.release()
    except KeeperUnavailable as exc:
        _fail(str(exc), EXIT_DAEMON)
    typer.echo(f"the pool of node {cfg.node.name} is not held any more (holder socket {keeper.path})")


@app.command("check-config")
def check_config(path: Path = typer.Argument(..., help="node.toml to validate")) -> None:
    """Validate a config file (and what `ecd serve` checks at start: the tcp/CURVE rule, key
    files, node.group) and print the effective configuration."""
    from ..daemon.ops.security import check_security
    try:
        cfg = load_config_file(path)
        check_security(cfg)
    except ConfigError as exc:
        _fail(f"config error: {exc}", EXIT_USAGE)
    typer.echo(dumps_toml(cfg), nl=False)


@app.command()
def keygen(directory: Path = typer.Argument(..., help="where to write the key pair (created if missing)"),
           name: str = typer.Option("ecd", "--name", help="file name stem: NAME.key and NAME.key_secret"),
           force: bool = typer.Option(False, "--force", help="overwrite an existing key pair"),
           tls: bool = typer.Option(False, "--tls", help="write a TLS pair for [cluster] tls instead: NAME.crt "
                                                         "and NAME.crt_secret (needs the openssl command)")) -> None:
    """Write a CURVE key pair: NAME.key (public) and NAME.key_secret (secret, mode 0600).

    The daemon's pair: point control.curve_secret_key at its .key_secret and give clients its
    .key. A client's pair: copy its .key into the daemon's control.curve_allowed_keys directory.
    With --tls: a self-signed certificate NAME.crt (peers pin it: copy it into their
    cluster.tls_allowed_certs directory) and its key NAME.crt_secret (mode 0600)."""
    from ..curve import write_keypair
    if not name or "/" in name or name.startswith("."):
        _fail(f"--name: must be a plain file name, got {name!r}", EXIT_USAGE)
    if tls:
        from ..transport.tls import fingerprint, write_tls_pair
        try:
            cert, key = write_tls_pair(str(directory), name, force)
        except FileExistsError as exc:
            _fail(f"{exc} exists: not overwriting it (use --force)", EXIT_USAGE)
        except (OSError, RuntimeError) as exc:
            _fail(f"cannot write a TLS pair in {directory}: {exc}", EXIT_USAGE)
        typer.echo(f"certificate: {cert}\nkey: {key}\nsha256: {fingerprint(cert)}")
        return
    try:
        public, secret = write_keypair(str(directory), name, force)
    except FileExistsError as exc:
        _fail(f"{exc} exists: not overwriting it (use --force)", EXIT_USAGE)
    except OSError as exc:
        _fail(f"cannot write keys in {directory}: {exc.strerror or exc}", EXIT_USAGE)
    typer.echo(f"public key: {public}\nsecret key: {secret}")


@app.command()
def version() -> None:
    """Print the ecd version."""
    typer.echo(__version__)


# ---- operator commands: options every daemon-facing command shares -------------------------

DEFAULT_ENDPOINT = ControlSection().endpoint  # configs/node.toml's

ConfigOpt = Annotated[Optional[Path], typer.Option(
    "--config", "-c", help="node.toml whose [control] endpoint to use", show_default=False)]
EndpointOpt = Annotated[Optional[str], typer.Option(
    "--endpoint", "-e", help=f"daemon endpoint [default: {DEFAULT_ENDPOINT}]", show_default=False)]
TimeoutOpt = Annotated[float, typer.Option("--timeout", min=0.001, help="seconds to wait for each daemon reply")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON document instead of tables")]
CurveSecretOpt = Annotated[Optional[str], typer.Option(
    "--curve-secret-key", envvar="ECD_CURVE_SECRET_KEY", show_default=False,
    help="this client's CURVE key file (NAME.key_secret from `ecd keygen`), for a daemon with CURVE")]
CurveServerOpt = Annotated[Optional[str], typer.Option(
    "--curve-server-key", envvar="ECD_CURVE_SERVER_KEY", show_default=False,
    help="the daemon's CURVE public key: its .key file or the 40-character Z85 text")]


class Target(NamedTuple):
    endpoint: str
    source: str  # where it came from, said when the daemon cannot be reached


def _endpoint(config: Optional[Path], endpoint: Optional[str]) -> Target:
    """Where the daemon is: --endpoint, else --config's (or $ECD_CONFIG's, which the image and the
    unit set) [control] endpoint, else ecd's default."""
    if config is not None and endpoint is not None:
        _fail("give --config or --endpoint, not both", EXIT_USAGE)
    if endpoint is not None:
        try:
            return Target(client_endpoint(endpoint, "--endpoint"), "--endpoint")
        except InvalidEndpoint as exc:
            _fail(str(exc), EXIT_USAGE)
    source = f"--config {config}" if config is not None else ""
    if config is None and os.environ.get("ECD_CONFIG"):
        config, source = Path(os.environ["ECD_CONFIG"]), f"ECD_CONFIG={os.environ['ECD_CONFIG']}"
    if config is not None:
        try:
            return Target(load_config_file(config).control.endpoint, f"[control] endpoint of {source}")
        except ConfigError as exc:
            _fail(f"config error ({source}): {exc}", EXIT_USAGE)
    return Target(DEFAULT_ENDPOINT, "the default; --endpoint, --config or $ECD_CONFIG name another")


@contextlib.contextmanager
def _daemon_errors(target: Target, timeout: float) -> Iterator[None]:
    """Daemon trouble as one line and an exit code, never a traceback."""
    endpoint = f"{target.endpoint} ({target.source})"
    try:
        yield
    except SocketPermissionDenied as exc:  # the daemon may well be running: the socket refuses us
        _fail(f"daemon unreachable at {endpoint}: {exc}", EXIT_UNREACHABLE)
    except DaemonUnavailable as exc:
        why = f"no answer within {timeout:g}s (is `ecd serve` running?)" if "within" in str(exc) else str(exc)
        _fail(f"daemon unreachable at {endpoint}: {why}", EXIT_UNREACHABLE)
    except AuthenticationFailed as exc:
        _fail(f"authentication failed: {exc}", EXIT_DAEMON)
    except EcdError as exc:
        _fail(f"daemon error: {exc}", EXIT_DAEMON)


def _check_curve_options(curve_secret_key: str | None, curve_server_key: str | None) -> None:
    """Bad --curve-* options are a usage error (exit 2), named as the user typed them."""
    from ..client.connection import curve_keys
    try:
        curve_keys(curve_secret_key, curve_server_key)
    except ValueError as exc:
        message = str(exc)
        for arg in ("curve_secret_key", "curve_server_key"):
            message = message.replace(arg, "--" + arg.replace("_", "-"))
        _fail(message, EXIT_USAGE)


def _client(endpoint: str, timeout: float, namespace: str = "default", curve_secret_key: str | None = None,
            curve_server_key: str | None = None):
    # The control plane only: an operator command moves no tensor bytes, so it maps no shared
    # memory and imports neither torch nor numpy (ecd.Client would: seconds of start-up).
    from ..client.control import ControlClient
    _check_curve_options(curve_secret_key, curve_server_key)
    return ControlClient(endpoint, namespace=namespace, timeout=timeout, name="ecd-cli",
                         curve_secret_key=curve_secret_key, curve_server_key=curve_server_key)


@app.command()
def status(config: ConfigOpt = None, endpoint: EndpointOpt = None, timeout: TimeoutOpt = 5.0,
           interval: Annotated[float, typer.Option("--interval", min=0.0, max=3600.0,
                                                   help="seconds between the two samples ops/s is measured "
                                                        "over (0: one sample, no ops/s)")] = 1.0,
           as_json: JsonOpt = False, curve_secret_key: CurveSecretOpt = None,
           curve_server_key: CurveServerOpt = None) -> None:
    """Pools, entries, clients, holds, hit rate and request rate of the daemon."""
    target = _endpoint(config, endpoint)
    ep = target.endpoint
    with _daemon_errors(target, timeout), _client(ep, timeout, "default", curve_secret_key, curve_server_key) as client:
        first, t_first = client.stats(), time.monotonic()
        last, t_last = first, t_first
        if interval > 0:
            time.sleep(interval)
            last, t_last = client.stats(), time.monotonic()
        own_session = client._session
    doc = status_document(ep, first, last, t_last - t_first, own_session)
    if as_json:
        print_json(doc)
    else:
        render_status(doc, stdout_console())


def status_document(endpoint: str, first: dict, last: dict, elapsed: float, own_session: int = 0) -> dict:
    ops_per_s = None
    if elapsed > 0:
        # Of this command's own requests, exactly one of its two Stats calls falls between the
        # samples (a daemon counts a request either before or after answering it: either way).
        delta = sum(last["ops"].values()) - sum(first["ops"].values()) - 1
        ops_per_s = max(0, delta) / elapsed
    lookups = last["hits"] + last["misses"]
    return {
        "endpoint": endpoint, "version": last["version"], "node": last["node"], "epoch": last["epoch"],
        "uptime_s": last["uptime_s"], "capacity_bytes": last["capacity_bytes"], "used_bytes": last["used_bytes"],
        "used_pct": percent(last["used_bytes"], last["capacity_bytes"]),
        "pools": [{"segment": i, "capacity_bytes": cap, "used_bytes": used, "used_pct": percent(used, cap)}
                  for i, (cap, used) in enumerate(last["pools"])],
        "entries": {"ready": last["entries_ready"], "writing": last["entries_writing"],
                    "retired": last["entries_retired"], "reservations": last["reservations"],
                    "reserved_bytes": last["reserved_bytes"]},
        "clients": max(0, last["clients"] - 1),  # not counting this command's own session
        "read_leases": last["read_leases"], "pins": last["pins"], "waiters": last["waiters"],
        "hits": last["hits"], "misses": last["misses"], "hit_rate": last["hits"] / lookups if lookups else None,
        "evictions": last["evictions"], "reclaimed_sessions": last["reclaimed_sessions"],
        "expired_writes": last["expired_writes"], "ring_events": last["ring_events"],
        "ops_per_s": ops_per_s, "interval_s": elapsed, "ops": last["ops"], "errors": last["errors"],
        "cluster": {"listen": last.get("cluster_listen", ""), "peers": last.get("peers", []),
                    "transfer_leases": last.get("transfer_leases", 0),
                    "fetches_in_flight": last.get("fetches_in_flight", 0),
                    "fetch_failures": last.get("fetch_failures", {}),
                    "directory": last.get("directory")},  # [cluster] directory: None without it
        "disk": last.get("disk"),  # [pool.disk]: None without a disk tier
        "restart": last.get("restart"),  # [restart]: what this start adopted (None: a daemon before it)
        "events": last.get("events"),  # [events]: the KV events published (None: off)
        # each client session: its pid, pid namespace, uid and how it is watched (not this command's own)
        "sessions": [s for s in last.get("sessions", []) if s["id"] != own_session],
    }


@app.command()
def keys(config: ConfigOpt = None, endpoint: EndpointOpt = None, timeout: TimeoutOpt = 5.0,
         namespace: Annotated[Optional[str], typer.Option("--namespace", "-n",
                                                          help="only this namespace [default: all]")] = None,
         limit: Annotated[int, typer.Option("--limit", min=1, max=1_000_000, help="list at most this many")] = 100,
         as_json: JsonOpt = False, curve_secret_key: CurveSecretOpt = None,
         curve_server_key: CurveServerOpt = None) -> None:
    """List ready entries by namespace and key, and keys on the disk tier (the tier column says where)."""
    target = _endpoint(config, endpoint)
    ep = target.endpoint
    with _daemon_errors(target, timeout), _client(ep, timeout, "default", curve_secret_key, curve_server_key) as client:
        total, entries = client.keys(namespace=namespace, limit=limit)
    if as_json:
        print_json({"total": total, "shown": len(entries), "namespace": namespace, "entries": entries})
    else:
        render_keys(total, entries, stdout_console())


@app.command()
def evict(keys: Annotated[Optional[list[str]], typer.Argument(help="keys to evict", show_default=False)] = None,
          namespace: Annotated[Optional[str], typer.Option(
              "--namespace", "-n", help="the keys' namespace [default: default]; without keys: the whole "
                                        "namespace", show_default=False)] = None,
          everything: Annotated[bool, typer.Option("--all", help="evict every entry of every namespace")] = False,
          force: Annotated[bool, typer.Option("--force", help="evict leased/pinned entries too, then wait "
                                                              "for their readers to let go")] = False,
          wait: Annotated[float, typer.Option("--wait", min=0.0, help="with --force: seconds to wait for "
                                                                      "readers")] = 30.0,
          config: ConfigOpt = None, endpoint: EndpointOpt = None, timeout: TimeoutOpt = 5.0,
          as_json: JsonOpt = False, curve_secret_key: CurveSecretOpt = None,
          curve_server_key: CurveServerOpt = None) -> None:
    """Evict keys, a whole namespace (--namespace, no keys), or everything (--all).

    Exit 1 if an entry was refused (leased or pinned, without --force) or readers of forced
    entries did not let go within --wait."""
    keys = keys or []
    if everything and (keys or namespace is not None):
        _fail("--all evicts everything: give no keys and no --namespace with it", EXIT_USAGE)
    if not keys and namespace is None and not everything:
        _fail("name the keys to evict, a --namespace to empty, or --all", EXIT_USAGE)
    target = _endpoint(config, endpoint)
    ep = target.endpoint
    with _daemon_errors(target, timeout), _client(ep, timeout, "default", curve_secret_key, curve_server_key) as client:
        if everything:
            result = client.evict(everything=True, force=force)
        elif keys:
            result = {"evicted": 0, "refused": [], "missing": [], "draining": []}
            batch = max(1, client.limits.max_batch)
            for start in range(0, len(keys), batch):
                part = client.evict(keys[start:start + batch], namespace=namespace or "default", force=force)
                for name in result:
                    result[name] += part[name]
        else:
            result = client.evict(namespace=namespace, force=force)
        still, waited = _drain(client, result["draining"], wait, show=not as_json)
    doc = {**result, "namespace": None if everything else (namespace or "default"), "all": everything,
           "force": force, "drained": not still, "still_held": len(still), "drain_wait_s": waited}
    if as_json:
        print_json(doc)
    else:
        render_evict(doc, stdout_console())
    if doc["refused"] or still:
        raise typer.Exit(EXIT_DAEMON)


def _drain(client, generations: list[int], wait: float, show: bool) -> tuple[list[int], float]:
    """Poll held() every 50 ms until the forced entries' readers let go or `wait` runs out;
    returns (generations still held, seconds waited)."""
    started = time.monotonic()
    still = list(generations)
    if not still:
        return still, 0.0
    batch = max(1, client.limits.max_batch)
    console = stderr_console()
    show = show and console.is_terminal  # a spinner only where there is someone to watch it
    spinner = console.status("") if show else contextlib.nullcontext()
    try:
        with spinner:
            while True:
                flags = [f for i in range(0, len(still), batch) for f in client.held(still[i:i + batch])]
                still = [g for g, held in zip(still, flags) if held]
                waited = time.monotonic() - started
                if not still or waited >= wait:
                    return still, waited
                if show:
                    spinner.update(f"waiting for readers of {len(still)} forced entr"
                                   f"{'y' if len(still) == 1 else 'ies'} to let go ({waited:.1f}s of {wait:g}s)")
                time.sleep(min(0.05, max(0.0, wait - waited)))
    except KeyboardInterrupt:
        _fail(f"stopped waiting: {len(still)} evicted entries still held by readers "
              "(freed when they release)", 130)


@app.command()
def bench(size: Annotated[Optional[list[str]], typer.Option(
              "--size", "-s", help="tensor size, repeatable (like the config: 1MiB, 64KiB) "
                                   "[default: 1MiB, 16MiB]", show_default=False)] = None,
          clients: Annotated[int, typer.Option("--clients", min=1, max=256, help="client processes")] = 4,
          seconds: Annotated[float, typer.Option("--seconds", min=0.1, max=3600.0, help="run time")] = 5.0,
          op: Annotated[BenchOp, typer.Option("--op", help="what each client loops")] = BenchOp.both,
          namespace: Annotated[str, typer.Option("--namespace", "-n", help="namespace of the bench keys "
                                                                            "(evicted at the end)")] = "ecd-bench",
          config: ConfigOpt = None, endpoint: EndpointOpt = None, timeout: TimeoutOpt = 5.0,
          as_json: JsonOpt = False, curve_secret_key: CurveSecretOpt = None,
          curve_server_key: CurveServerOpt = None) -> None:
    """Measure put/get throughput and latency against a running daemon."""
    from .bench import run_bench
    sizes = []
    for text in size or ["1MiB", "16MiB"]:
        try:
            n = parse_size(text)
        except ValueError as exc:
            _fail(f"--size: {exc}", EXIT_USAGE)
        if n <= 0:
            _fail(f"--size: must be > 0, got {text!r}", EXIT_USAGE)
        sizes.append(n)
    target = _endpoint(config, endpoint)
    ep = target.endpoint
    # Checked here, once, so a bad key file is a usage error rather than N failing workers.
    _check_curve_options(curve_secret_key, curve_server_key)
    curve = {"curve_secret_key": curve_secret_key, "curve_server_key": curve_server_key}
    with _daemon_errors(target, timeout):
        try:
            if as_json:
                doc = run_bench(ep, timeout, sizes, clients, seconds, op.value, namespace, client_options=curve)
            else:
                with _bench_progress() as progress:
                    doc = run_bench(ep, timeout, sizes, clients, seconds, op.value, namespace, progress,
                                    client_options=curve)
        except ValueError as exc:
            _fail(str(exc), EXIT_USAGE)
        except KeyboardInterrupt:
            _fail("bench interrupted before it measured anything; its keys were evicted", 130)
    if as_json:
        print_json(doc)
    else:
        render_bench(doc, stdout_console())


@contextlib.contextmanager
def _bench_progress() -> Iterator:
    """A progress bar on stderr, shown from the first update on (an early error prints alone)."""
    from rich.progress import (BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn,
                               TimeRemainingColumn)
    console = stderr_console()
    if not console.is_terminal:  # nothing to animate into a log file
        yield None
        return
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                   TimeRemainingColumn(), TextColumn("{task.fields[ops]} ops"), console=console, transient=True)
    task = bar.add_task("starting clients", total=1.0, ops=0)
    phase: list[str | None] = [None]

    def update(now: str, fraction: float, ops: int) -> None:
        if phase[0] is None:
            bar.start()
        elif now != phase[0]:
            bar.reset(task, description="running", total=1.0, ops=0)
        phase[0] = now
        bar.update(task, completed=fraction, ops=ops)
    try:
        yield update
    finally:
        if phase[0] is not None:
            bar.stop()


def main() -> None:
    app()
