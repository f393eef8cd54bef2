"""The backend's command line (also reachable as `stepwise serve|keys|export`).

    python -m kernel_backend serve --host 127.0.0.1 --port 8000 [--workers N [--shard M]] [--supervise]
    python -m kernel_backend keys create --tenant NAME | list | revoke KEY_OR_PREFIX
    python -m kernel_backend admin tenants [--url URL] [--key KEY] [--json]
    python -m kernel_backend backup --to DIR | restore --from DIR
    python -m kernel_backend export tinker://RUN/weights/NAME --to DIR [--merged]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

# Before torch loads OpenMP: idle threads sleep instead of spinning. On a machine shared with a
# notebook kernel or tests, spinning threads slow every step 5-10x (docs/performance.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kernel_backend")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the training-session service")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--log-level", default="warning")
    serve.add_argument("--workers", type=int, default=None,
                       help="start a Ray head on loopback with this many engine workers (STEPWISE_WORKERS); "
                            "STEPWISE_RAY_ADDRESS joins an existing Ray cluster instead")
    serve.add_argument("--shard", type=int, default=None, metavar="M",
                       help="shard each base model over groups of this many workers (STEPWISE_SHARD; --workers a "
                            "multiple of it): each worker holds about 1/M of the base weights, and a group serves "
                            "training runs and samplers as one worker does, its rank 0 deciding every batch and the "
                            "others running the same; for models larger than one worker (docs/architecture.md). Without it, "
                            "a model whose weights exceed half a CPU worker's memory budget is sharded over as few "
                            "workers as it fits")
    serve.add_argument("--exit-when-unused", action="store_true",
                       help="stop once no live process has announced itself in $STEPWISE_HOME/runtime "
                            "(how workbench.connect() starts the embedded backend; see kernel_backend/runtime.py)")
    serve.add_argument("--supervise", action="store_true",
                       help="run the backend as a child and start it again, on the same port and key, if it dies "
                            "(kernel_backend/supervise.py; how workbench.connect() starts the embedded backend)")

    keys_cmd = sub.add_parser("keys", help="manage API keys (stored hashed, one tenant each)")
    keys_sub = keys_cmd.add_subparsers(dest="action", required=True)
    create = keys_sub.add_parser("create", help="make a key for a tenant and print it (shown once)")
    create.add_argument("--tenant", required=True)
    keys_sub.add_parser("list", help="list keys: prefix, tenant, created, revoked")
    revoke = keys_sub.add_parser("revoke", help="revoke a key, by the key or its listed prefix")
    revoke.add_argument("key")

    admin = sub.add_parser("admin", help="the operator's view of a running server")
    admin_sub = admin.add_subparsers(dest="action", required=True)
    tenants = admin_sub.add_parser("tenants", help="every tenant: spend, tokens, runs, checkpoints, storage, budgets, keys")
    tenants.add_argument("--url", help="the server (default: the one serving $STEPWISE_HOME, runtime/backend.json)")
    tenants.add_argument("--key", help="the operator's key (default: $STEPWISE_LOCAL_KEY, else the home's own)")
    tenants.add_argument("--json", action="store_true", help="print the server's answer as JSON")

    backup_cmd = sub.add_parser("backup", help="copy the database and the local checkpoint store into a new folder")
    backup_cmd.add_argument("--to", required=True, help="the folder to write (new or empty)")
    restore_cmd = sub.add_parser("restore", help="restore a backup into this home's empty database and store")
    restore_cmd.add_argument("--from", dest="source", required=True, help="a folder `stepwise backup` wrote")

    export = sub.add_parser("export", help="write a checkpoint as a PEFT adapter folder, or a merged model")
    export.add_argument("path", help="tinker://RUN/weights/NAME, tinker://RUN/sampler_weights/NAME, or a checkpoint folder")
    export.add_argument("--to", required=True, help="the folder to write")
    export.add_argument("--merged", action="store_true", help="merge the adapter into the base model's weights")
    args = parser.parse_args(argv)
    if args.command == "serve" and args.supervise:
        from kernel_backend.supervise import supervise

        given = list(argv) if argv is not None else sys.argv[1:]
        raise SystemExit(supervise([a for a in given[given.index("serve") + 1:] if a != "--supervise"]))

    from kernel_backend.config import SettingError, Settings, unknown_variables

    for warning in unknown_variables():
        print(f"stepwise: warning: {warning}", file=sys.stderr)
    # serve's --workers and --shard stand for STEPWISE_WORKERS and STEPWISE_SHARD, checked with the rest.
    options = {"workers": args.workers, "shard": args.shard} if args.command == "serve" else {}
    options = {name: value for name, value in options.items() if value is not None}
    try:
        settings = Settings(**options)  # every value checked here, once (config.check)
    except SettingError as error:  # one line, no traceback; 2, as argparse exits on a bad option
        flags = "".join(f" --{name} {value}" for name, value in options.items())
        print(f"stepwise {args.command}: {error}" + (f" (the command line:{flags})" if flags else ""), file=sys.stderr)
        raise SystemExit(2) from None
    if args.command == "serve":
        serve_forever(settings, args.host, args.port, args.log_level, args.exit_when_unused)
        return

    if args.command == "admin":
        from kernel_backend.operator_cli import print_tenants

        print_tenants(settings, args.url, args.key, as_json=args.json)
        return

    if args.command in ("backup", "restore"):
        from kernel_backend import backup

        if args.command == "backup":
            summary = backup.backup(settings, args.to)
            print(f"backed up {sum(summary['tables'].values())} rows of {len(summary['tables'])} tables and "
                  f"{len(summary['checkpoints'])} checkpoints to {args.to}"
                  + (f" ({summary['storage_url']} itself not copied)" if summary["storage_url"] else ""))
        else:
            summary = backup.restore(settings, args.source)
            print(f"restored {sum(summary['tables'].values())} rows and {len(summary['checkpoints'])} checkpoints "
                  f"into {settings.home}" + (f"; missing: {summary['checkpoints_absent']}"
                                             if summary["checkpoints_absent"] else ""))
        return

    from kernel_backend.persistence import api_keys
    from kernel_backend.persistence.database import Store

    store = Store(settings.database_url)
    if args.command == "keys":
        if args.action == "create":
            print(api_keys.create(store, args.tenant))
        elif args.action == "list":
            for row in api_keys.list_keys(store):
                state = f"revoked {row.revoked_at:%Y-%m-%d %H:%M}" if row.revoked_at else "active"
                print(f"{row.prefix}…  tenant={row.tenant}  created={row.created_at:%Y-%m-%d %H:%M}  {state}")
        else:
            count = api_keys.revoke(store, args.key)
            if not count:
                raise SystemExit(f"no active key matches {args.key!r}; `keys list` shows their prefixes")
            print(f"revoked {count} key(s)")
        return

    from kernel_backend.export import export_checkpoint

    export_checkpoint(store, settings, args.path, args.to, merged=args.merged)
    print(f"wrote {'a merged model' if args.merged else 'a PEFT adapter'} to {args.to}")


def serve_forever(settings, host: str, port: int, log_level: str, exit_when_unused: bool) -> None:
    """Serve until stopped, announced in $STEPWISE_HOME/runtime/backend.json so that other
    processes of this home share this backend (kernel_backend/runtime.py)."""
    import signal
    import sys
    import threading

    import uvicorn

    from kernel_backend import runtime
    from kernel_backend.api.app import create_app

    from kernel_backend.api.monitoring import configure_logging
    from kernel_backend.errors import HomeInUse

    configure_logging(settings.log_format)  # a line per request (api/monitoring.py), as text or JSON

    # A server only this machine can reach is one user's: unless a tenant share is set, the tenant has the whole
    # adapter cache (a full fine-tuning run then needs STEPWISE_ADAPTER_CACHE_MB alone). Set in the environment too,
    # for the Ray workers this process starts.
    if runtime.is_loopback(host) and "STEPWISE_MAX_ADAPTER_MB_PER_TENANT" not in os.environ:
        os.environ["STEPWISE_MAX_ADAPTER_MB_PER_TENANT"] = "0"
        settings.max_adapter_mb_per_tenant = 0
    try:
        app = create_app(settings)  # takes the home's lock: a second backend of this home stops here
    except HomeInUse as error:
        raise SystemExit(f"stepwise serve: {error}") from None
    # The well-known local key only where nobody but this machine can reach the server.
    loopback = runtime.is_loopback(host)
    app.state.loopback_key = settings.loopback_key if loopback else ""
    # It is a real key of tenant "local" while the server listens on loopback (so the SDK's JWT exchange
    # works for it too), and revoked when the same home is served on any other address.
    if settings.loopback_key:
        from kernel_backend.persistence import api_keys

        if loopback:
            api_keys.create(app.state.service.store, api_keys.LOCAL_TENANT, settings.loopback_key)
        else:
            api_keys.revoke(app.state.service.store, settings.loopback_key)
    url_host = "127.0.0.1" if loopback or host in ("0.0.0.0", "::", "") else host
    base_url = f"http://{url_host}:{port}"
    # uvicorn's own access lines off: the request log (api/monitoring.py) has one line per request, with its tenant.
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False))

    def when_ready() -> None:
        while not server.started and not server.should_exit:
            threading.Event().wait(0.2)
        if server.started:
            logging.getLogger("stepwise.startup").info("ready at %s", base_url)
            if exit_when_unused:
                runtime.exit_when_unused(settings.home, base_url, stop=lambda: setattr(server, "should_exit", True))

    announced = runtime.announce_backend(settings.home, base_url, settings.local_key, app.state.loopback_key,
                                         os.environ.get("STEPWISE_LOG"), exit_when_unused)
    threading.Thread(target=when_ready, name="stepwise-ready", daemon=True).start()
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again for the previous handler:
    # make that one an exit that runs the `finally` below (the default would end the process first).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        server.run()
    finally:
        runtime.withdraw_backend(announced)


if __name__ == "__main__":
    main()
