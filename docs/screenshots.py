"""Screenshots of the built docs site for docs/img/ (home page and one results page).

Serves ``site/`` (run ``make docs`` first) on a free loopback port with the standard
library's HTTP server, points headless Chromium (Debian's ``chromium`` package) at two
pages, then stops the server it started, by its pid. Run: ``python docs/screenshots.py``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = {"docs-home.png": "", "docs-results-odsbo.png": "results/odsbo/"}
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--virtual-time-budget=3000", "--window-size=1280,900"]


def main() -> int:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("error: chromium not found\nhint: apt-get install -y chromium", file=sys.stderr)
        return 2
    if not (ROOT / "site" / "index.html").exists():
        print("error: site/ is not built\nhint: make docs", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                               "127.0.0.1", "--directory", str(ROOT / "site")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}/"
        for _ in range(50):
            try:
                urllib.request.urlopen(base, timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        for name, path in PAGES.items():
            out = ROOT / "docs" / "img" / name
            subprocess.run([browser, *FLAGS, f"--screenshot={out}", base + path], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
            print(f"wrote {out}")
    finally:
        server.terminate()
        server.wait(timeout=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
