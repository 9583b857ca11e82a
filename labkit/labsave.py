"""What the book's JupyterLab server does before it writes a notebook: opening is not editing.

./book.sh starts JupyterLab with

    --ContentsManager.pre_save_hook=labkit.labsave.pre_save_hook

and every save (a reader's Ctrl+S or an autosave) passes through `pre_save_hook` first:

* A PNG next to a plotly figure is dropped. The plotly extension draws one into the figure's
  output each time it renders the figure (to show offline); it makes a chapter look edited as soon
  as it is opened, is never the same twice (window size, fonts), and would make every chapter
  heavier than nbcheck allows. The figure itself (its plotly JSON) stays.
* A notebook whose content is what the file on disk already holds, once both are read the way
  JupyterLab writes them (labkit.nbfile) and leaving aside what the reader's own kernel stamps
  into it (language_info, the kernel's display name), is written back exactly as it was on disk:
  a reader who only reads leaves `git status` clean, whatever their Python version.

Anything else the reader changed is saved as JupyterLab sends it.
"""
from __future__ import annotations

import json
from pathlib import Path

import nbformat

from labkit.nbfile import dumps

PLOTLY = "application/vnd.plotly.v1+json"


def drop_plotly_pngs(nb: dict) -> int:
    """Remove the browser-drawn PNG from every plotly output of `nb` (a plain dict); return how
    many it removed."""
    dropped = 0
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            data = out.get("data") or {}
            if PLOTLY in data and "image/png" in data:
                del data["image/png"]
                dropped += 1
    return dropped


def comparable(nb: dict) -> dict:
    """`nb` as the server would write it (JupyterLab's format, and without what nbformat never
    writes, such as the `trusted` flag JupyterLab sends in cell metadata), less what depends on
    the reader's kernel."""
    nb = json.loads(dumps(nb))
    drop_plotly_pngs(nb)
    nb["metadata"].pop("language_info", None)
    spec = nb["metadata"].get("kernelspec")
    if isinstance(spec, dict):
        spec.pop("display_name", None)
    return nb


def _on_disk(contents_manager, path: str):
    os_path = getattr(contents_manager, "_get_os_path", None)
    if os_path is None:  # not a file-backed contents manager: nothing to compare with
        return None
    file = Path(os_path(path))
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def pre_save_hook(model, path, contents_manager=None, **kwargs):
    """jupyter_server's ContentsManager.pre_save_hook: edits `model` in place."""
    if model.get("type") != "notebook" or not isinstance(model.get("content"), dict):
        return
    content = model["content"]
    dropped = drop_plotly_pngs(content)
    disk = _on_disk(contents_manager, path) if contents_manager is not None else None
    if disk is not None and comparable(content) == comparable(disk):
        # The server writes this with nbformat: the same bytes as the file, which nbformat
        # (labkit.nbfile) wrote.
        model["content"] = nbformat.from_dict(disk)
        if contents_manager is not None:
            contents_manager.log.info("labsave: %s unchanged by the reader; kept as on disk", path)
    elif dropped and contents_manager is not None:
        contents_manager.log.info("labsave: %s: %d plotly PNG(s) left out", path, dropped)
