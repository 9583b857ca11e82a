"""Serve a built site on 127.0.0.1: the calculators' Pyodide cannot load from file://.

    labkit site serve [--dir build/site] [--port 8000]     (labkit.site.main)
"""
from __future__ import annotations

import functools
import http.server
from pathlib import Path


class _Handler(http.server.SimpleHTTPRequestHandler):
    # Pyodide imports .mjs modules and compiles the .wasm streaming: both need their MIME types.
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map,
                      ".mjs": "text/javascript", ".wasm": "application/wasm",
                      ".js": "text/javascript", ".json": "application/json"}

    def log_message(self, *args):  # quiet
        return


def server(folder: Path, port: int = 8000,
           host: str = "127.0.0.1") -> http.server.ThreadingHTTPServer:
    """An HTTP server for the built site (the calculators' Pyodide cannot load from file://)."""
    handler = functools.partial(_Handler, directory=str(folder))
    return http.server.ThreadingHTTPServer((host, port), handler)
