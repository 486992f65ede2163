"""``uv pip install ARGS`` into this Python's environment, with this machine's pip configuration.

uv reads no pip configuration: this passes it the equivalent of what ``pip config list`` shows
(the files and the PIP_* variables), so that it installs from the same indexes, links and
constraints, and takes, as pip does, the best version any of them offers. Usage::

    python .ci/uv_install.py UV ARGS...   # UV: the uv executable

Exit status 2, naming the setting, where pip is configured with an option that has no
translation here (.ci/run then installs with pip); else uv's.
"""

from __future__ import annotations

import os
import subprocess
import sys

# pip's option: uv's. A list of pip's (space-separated) gives one uv option per item.
OPTIONS = {
    "index-url": "--default-index",
    "extra-index-url": "--index",
    "find-links": "--find-links",
    "constraint": "--constraints",
}
ENV = {"cert": "SSL_CERT_FILE", "timeout": "UV_HTTP_TIMEOUT", "default-timeout": "UV_HTTP_TIMEOUT"}
IGNORED = {"disable-pip-version-check", "no-cache-dir", "progress-bar", "quiet"}


def pip_settings() -> dict[str, str]:
    """pip's settings for ``install``, the later of a name winning (pip's order)."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    settings = {}
    for line in listed.splitlines():  # e.g. global.find-links='/opt/wheels'
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if section in ("global", "install", ":env:"):
            settings[name] = value.strip("'\"")
    return settings


def main(argv: list[str]) -> int:
    uv, *args = argv[1:]
    command = [uv, "pip", "install", "--python", sys.executable]
    command += ["--index-strategy", "unsafe-best-match"]  # pip's choice among the indexes
    env = dict(os.environ)
    for name, value in pip_settings().items():
        if name in OPTIONS:
            command += [part for item in value.split() for part in (OPTIONS[name], item)]
        elif name in ENV:
            env[ENV[name]] = value
        elif name not in IGNORED:
            print(f".ci/uv_install.py: pip's {name}={value!r} has no uv translation here")
            return 2
    return subprocess.run([*command, *args], env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv))
