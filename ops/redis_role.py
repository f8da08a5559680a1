"""``python -m ibex_context.ops.redis_role --dir DIR``: the deployment's Redis (``up --role redis``).

The embedded server (``memory.embedded_redis.server``: Redis 8 with the query engine) serving
``IBEX_REDIS_URL``, the URL every host of the deployment connects to: it listens on that URL's
host and port with its password (``ops.roles.redis_listen``) and keeps its data in ``DIR``
(append-only file). The password goes into a 0600 config file in ``DIR``, never onto the command
line, where any local user could read it. Replaces itself with the server (``exec``), so the
supervisor's signals reach it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..memory.embedded_redis.server import RedisStartError, redis_executable, server_args
from ..shared.config.settings import RedisSettings
from .roles import RoleError, redis_listen

AUTH_CONF = "auth.conf"


def _quoted(value: str) -> str:
    """A redis.conf double-quoted string: printable ASCII as is, every other byte as \\xHH."""
    out = []
    for byte in value.encode():
        ch = chr(byte)
        out.append(ch if 0x20 <= byte < 0x7F and ch not in '"\\' else f"\\x{byte:02x}")
    return '"' + "".join(out) + '"'


def write_auth_conf(directory: Path, password: str | None) -> Path:
    """The config file holding the default user's password (empty without one), mode 0600."""
    path = directory / AUTH_CONF
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        if password:
            f.write(f"requirepass {_quoted(password)}\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ibex_context.ops.redis_role", description=__doc__)
    ap.add_argument("--dir", required=True, help="where the data is kept (created if missing)")
    args = ap.parse_args(argv)
    try:
        bind, port, password = redis_listen(RedisSettings().redis_url or "")
        exe = redis_executable()
        directory = Path(args.dir)
        directory.mkdir(parents=True, exist_ok=True)
        conf = write_auth_conf(directory, password)
    except (RoleError, RedisStartError, OSError) as exc:
        print(f"redis: {exc}", file=sys.stderr)
        return 2
    argv_exec = server_args(exe, port=port, bind=bind, workdir=str(directory), persist=True)
    argv_exec.insert(1, str(conf))  # redis-server CONFIG-FILE [OPTIONS]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(exe, argv_exec)
    return 0  # pragma: no cover - execv does not return


if __name__ == "__main__":
    sys.exit(main())
