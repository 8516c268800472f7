#!/usr/bin/env python3
"""Start, check and stop a detached tritonserver for a model repository.

The server comes from the nvidia-pytriton wheel in this venv (or ``TRITONSERVER=/path/to/tritonserver``
in an NGC container); the python models run in this venv (its ``bin`` goes first on the server's PATH).
The PID file holds just the PID; ``status`` and ``stop`` check that the PID still is a tritonserver
before touching it, and ``status`` reads the gRPC address from the process's own command line.

Example (from the repository root)::

    .venv/bin/python scripts/server.py start model_repository --pid-file out/triton.pid --log-file out/triton.log
    .venv/bin/python scripts/server.py status --pid-file out/triton.pid
    .venv/bin/python scripts/server.py stop --pid-file out/triton.pid

``start`` prints ``grpc=127.0.0.1:PORT pid=PID ready_s=SECONDS`` and exits 0 once the server is live and
ready; if it dies or times out it prints the log tail and exits 1. ``status`` exits 0 only if the server is
running and ready, ``stop`` exits 0 if it stopped (or was not running).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from s3flow.server import triton_server
from s3flow.server.access import ServerTls


def _read_pid(pid_file: pathlib.Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _triton_cmdline(pid: int | None) -> list[str] | None:
    """argv of ``pid`` if it is a live tritonserver, else None (guards against a reused PID)."""
    if pid is None:
        return None
    argv = triton_server.read_cmdline(pid)
    if not argv or not pathlib.Path(argv[0]).name.startswith("tritonserver"):
        return None
    return argv


def _flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def cmd_start(args: argparse.Namespace) -> int:
    old = _triton_cmdline(_read_pid(args.pid_file))
    if old is not None:
        print(f"error: a tritonserver (pid {_read_pid(args.pid_file)}) from {args.pid_file} is still running; "
              "stop it first", file=sys.stderr)
        return 1
    log_file = args.log_file or args.pid_file.with_suffix(".log")
    extra = list(args.extra or [])
    if args.log_verbose:
        extra.append(f"--log-verbose={args.log_verbose}")
    try:
        admin_key = args.admin_key_file.read_text().strip() if args.admin_key_file else None
        tls = ServerTls(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert or args.tls_key else None
        server = triton_server.TritonServer(
            args.repository,
            host=args.host,
            grpc_port=args.grpc_port,
            http_port=args.http_port,
            metrics_port=args.metrics_port,
            log_file=log_file,
            model_control_mode=args.model_control_mode,
            load_models=args.load_model or (),
            extra_args=extra,
            venv=args.venv if args.venv is not None else "auto",
            admin_key=admin_key,
            tls=tls,
            tenants=args.tenants,
        )
        server.start()
        args.pid_file.parent.mkdir(parents=True, exist_ok=True)
        args.pid_file.write_text(f"{server.pid}\n")
        ready_s = server.wait_ready(args.timeout)
    except (triton_server.TritonServerError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        args.pid_file.unlink(missing_ok=True)
        return 1
    args.pid_file.write_text(f"{server.pid}\n")  # a port clash may have restarted it under a new PID
    print(f"grpc={server.grpc_url} http={server.http_url} pid={server.pid} ready_s={ready_s:.1f} log={log_file}")
    server.process = None  # detach: keep it running after we exit
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    pid = _read_pid(args.pid_file)
    argv = _triton_cmdline(pid)
    if argv is None:
        print(f"not running (pid file {args.pid_file}: {pid})")
        return 1
    url = f"{_flag(argv, 'grpc-address') or '0.0.0.0'}:{_flag(argv, 'grpc-port') or 8001}"
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from s3flow.server.access import admin_headers

    client = grpcclient.InferenceServerClient(url)
    try:
        ready = client.is_server_live(client_timeout=5) and client.is_server_ready(client_timeout=5)
        index = client.get_model_repository_index(headers=admin_headers())  # restricted: $S3FLOW_ADMIN_KEY
        models = [m.name for m in index.models if m.state == "READY"]
    except InferenceServerException as err:
        print(f"running but not answering: pid={pid} grpc={url}: {err}")
        return 1
    finally:
        client.close()
    print(f"{'ready' if ready else 'not ready'} pid={pid} grpc={url} models={','.join(models)}")
    return 0 if ready else 1


def cmd_stop(args: argparse.Namespace) -> int:
    pid = _read_pid(args.pid_file)
    if _triton_cmdline(pid) is None:
        print(f"not running (pid file {args.pid_file}: {pid})")
        args.pid_file.unlink(missing_ok=True)
        return 0
    t0 = time.monotonic()
    graceful = triton_server.stop_server_pid(pid, timeout=args.timeout)
    if triton_server.is_running(pid):
        print(f"error: pid {pid} still running", file=sys.stderr)
        return 1
    args.pid_file.unlink(missing_ok=True)
    print(f"stopped pid={pid} in {time.monotonic() - t0:.1f} s ({'SIGTERM' if graceful else 'SIGKILL'})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    start = sub.add_parser("start", help="start a detached server and wait until it is ready",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    start.add_argument("repository", type=pathlib.Path, help="model repository folder")
    start.add_argument("--pid-file", type=pathlib.Path, default=pathlib.Path("out/tritonserver.pid"),
                       help="where to write the server's PID")
    start.add_argument("--log-file", type=pathlib.Path, default=None,
                       help="server stdout+stderr; None = the pid file with suffix .log")
    ports = start.add_argument_group("network (a free port is chosen for each one not given)")
    ports.add_argument("--host", default="127.0.0.1", help="address all endpoints bind to")
    ports.add_argument("--grpc-port", type=int, default=None, help="gRPC port")
    ports.add_argument("--http-port", type=int, default=None, help="HTTP port")
    ports.add_argument("--metrics-port", type=int, default=None, help="Prometheus metrics port")
    models = start.add_argument_group("models")
    models.add_argument("--model-control-mode", choices=triton_server.MODEL_CONTROL_MODES, default="none",
                        help="none: load all at start; explicit: load/unload over the API")
    models.add_argument("--load-model", action="append", help="model to load at start in explicit mode; repeatable")
    models.add_argument("--venv", type=pathlib.Path, default=None,
                        help="venv the python models run in; None = the venv running this script")
    access = start.add_argument_group("access (docs/security.md)")
    access.add_argument("--admin-key-file", type=pathlib.Path, default=None,
                        help="restrict every API category a streaming client does not need to calls with this "
                             "key (header s3flow-admin-key; our tools send $S3FLOW_ADMIN_KEY)")
    access.add_argument("--tenants", action="store_true",
                        help="voices per tenant, named by the s3flow-tenant header (only behind a router that sets "
                             "it after authenticating the client)")
    access.add_argument("--tls-cert", type=pathlib.Path, help="gRPC TLS: the server's PEM certificate")
    access.add_argument("--tls-key", type=pathlib.Path, help="gRPC TLS: the server's PEM key")
    access.add_argument("--tls-client-ca", type=pathlib.Path,
                        help="mutual TLS: clients must present a certificate this CA signed")
    start.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for ready")
    start.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    start.add_argument("--extra", action="append",
                       help="extra tritonserver flag, repeatable, e.g. --extra=--log-info=false")
    start.set_defaults(func=cmd_start)

    for name, func, text in (("status", cmd_status, "is the server running and ready?"),
                             ("stop", cmd_stop, "stop the server by its PID (SIGTERM, then SIGKILL)")):
        p = sub.add_parser(name, help=text, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        p.add_argument("--pid-file", type=pathlib.Path, default=pathlib.Path("out/tritonserver.pid"),
                       help="PID file written by start")
        if name == "stop":
            p.add_argument("--timeout", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
        p.set_defaults(func=func)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
